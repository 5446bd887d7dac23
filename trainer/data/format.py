"""The prepared-dataset format: a directory holding

  train.bin / val.bin  flat token streams (every document followed by the EOT token),
  tokenizer.json       the tokenizer that produced them (trained here, or a copy of data.tokenizer),
  manifest.json        vocab size, dtype, token counts, source, tokenizer and sha256 of the three files.

A dataset is built under a temporary name next to its final place and renamed at the end, so a
directory with the final name is always complete.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

EOT_TOKEN = "<|endoftext|>"
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
SPLITS = ("train", "val")
FORMAT = "attnres-tokens-v1"
# "tokenizer" is newer than the format and optional: datasets built before it were all trained BPEs.
MANIFEST_KEYS = {"source", "requested_vocab_size", "vocab_size", "dtype", "tokens", "sha256"}
# The tail of the token stream is held out: one contiguous block that never overlaps train.
VAL_FRACTION = 0.02


class DataError(ValueError):
    """Data that cannot be used as given; the message is one line naming the path or key and what would work."""


class DataPreparationError(DataError):
    """A dataset could not be prepared."""


class DatasetCorruptError(DataError):
    """A prepared dataset does not match its manifest; the message names the file."""


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


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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


def manifest_tokenizer(manifest: dict) -> dict:
    """What made the dataset's tokenizer: {"kind": "bpe", "vocab_size": V} or {"kind": "file", "sha256": ..., "path": ...}."""
    return manifest.get("tokenizer") or {"kind": "bpe", "vocab_size": manifest["requested_vocab_size"]}


def tokenizer_identity(record: dict) -> dict:
    """The part of a tokenizer record that decides the tokens: where a given file was read from does not."""
    return {key: value for key, value in record.items() if key != "path"}


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
