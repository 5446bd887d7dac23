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
import re
import reprlib
from pathlib import Path
from typing import Callable

import numpy as np

EOT_TOKEN = "<|endoftext|>"
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
SPLITS = ("train", "val")
FORMAT = "attnres-tokens-v1"
TOKEN_DTYPES = ("uint16", "uint32")
CHECKSUMMED_NAMES = ("train.bin", "val.bin", TOKENIZER_NAME)
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# A manifest is about a kilobyte; a bigger one was not written here, and reading it whole must stay cheap.
MANIFEST_MAX_BYTES = 1 << 20
HASH_CHUNK_BYTES = 1 << 20
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
        for chunk in iter(lambda: f.read(HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(dataset_dir: Path) -> dict:
    path = Path(dataset_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; {dataset_dir} is not a prepared dataset")
    size = path.stat().st_size
    if size > MANIFEST_MAX_BYTES:
        raise DatasetCorruptError(f"{path}: {size} bytes, more than the {MANIFEST_MAX_BYTES} a manifest can be; "
                                  f"delete {dataset_dir} to rebuild it")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, or nesting deeper than the parser goes
        reason = str(e).splitlines()[0] if isinstance(e, ValueError) else "nested too deeply"
        raise DatasetCorruptError(f"{path}: not valid JSON ({reason}); delete {dataset_dir} to rebuild it") from None
    return check_manifest(path, manifest)


_MISSING = object()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and SHA256_HEX.fullmatch(value) is not None


def _field(path: Path, mapping: dict, key: str, label: str, is_valid: Callable[[object], bool], valid: str):
    """mapping[key] if is_valid says it is usable, else the one-line refusal naming `label` and what would be valid."""
    value = mapping.get(key, _MISSING)
    if value is _MISSING:
        raise DatasetCorruptError(f"{path}: no {label} (it must be {valid}); delete {path.parent} to rebuild it")
    if not is_valid(value):
        raise DatasetCorruptError(f"{path}: {label}={reprlib.repr(value)} must be {valid}; "
                                  f"delete {path.parent} to rebuild it")
    return value


def check_manifest(path: Path, manifest: object) -> dict:
    """The manifest if every field has the type and range build_dataset writes: its numbers size memmaps and
    index the vocab, so they are checked before anything is opened. `tokenizer` is newer than the format and
    optional: datasets built before it were all trained BPEs of requested_vocab_size."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetCorruptError(f"{path}: not an {FORMAT} manifest; delete {path.parent} to rebuild it")
    _field(path, manifest, "source", "source", lambda v: isinstance(v, dict) and isinstance(v.get("fingerprint"), str),
           "an object with a string 'fingerprint'")
    dtype = _field(path, manifest, "dtype", "dtype", lambda v: v in TOKEN_DTYPES, " or ".join(TOKEN_DTYPES))
    ids = 2 ** (8 * np.dtype(dtype).itemsize)
    vocab_size = _field(path, manifest, "vocab_size", "vocab_size", lambda v: _is_int(v) and 1 <= v <= ids,
                        f"an integer in [1, {ids}] ({dtype} ids)")
    _field(path, manifest, "eot_id", "eot_id", lambda v: _is_int(v) and 0 <= v < vocab_size,
           f"an integer in [0, vocab_size={vocab_size})")
    _field(path, manifest, "eot_token", "eot_token", lambda v: isinstance(v, str), "a string")
    _field(path, manifest, "documents", "documents", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    _field(path, manifest, "val_fraction", "val_fraction",
           lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1, "a number in (0, 1)")
    tokens = _field(path, manifest, "tokens", "tokens", lambda v: isinstance(v, dict), "an object {train, val}")
    for split in SPLITS:
        _field(path, tokens, split, f"tokens.{split}", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    checksums = _field(path, manifest, "sha256", "sha256",
                       lambda v: isinstance(v, dict) and set(v) == set(CHECKSUMMED_NAMES),
                       f"an object holding exactly {', '.join(CHECKSUMMED_NAMES)}")
    for name in CHECKSUMMED_NAMES:
        _field(path, checksums, name, f"sha256.{name}", _is_sha256, "64 lowercase hex digits")
    with_record = "tokenizer" in manifest
    _field(path, manifest, "requested_vocab_size", "requested_vocab_size",
           lambda v: (v is None and with_record) or (_is_int(v) and v >= 1),
           "an integer >= 1 (null only with a tokenizer record)")
    if with_record:
        record = _field(path, manifest, "tokenizer", "tokenizer",
                        lambda v: isinstance(v, dict) and v.get("kind") in ("bpe", "file"),
                        "an object whose kind is bpe or file")
        if record["kind"] == "bpe":
            _field(path, record, "vocab_size", "tokenizer.vocab_size", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        else:
            _field(path, record, "sha256", "tokenizer.sha256", _is_sha256, "64 lowercase hex digits")
            _field(path, record, "path", "tokenizer.path", lambda v: isinstance(v, str), "a string")
    return manifest


def manifest_tokenizer(manifest: dict) -> dict:
    """What made the dataset's tokenizer: {"kind": "bpe", "vocab_size": V} or {"kind": "file", "sha256": ..., "path": ...}."""
    return manifest.get("tokenizer") or {"kind": "bpe", "vocab_size": manifest["requested_vocab_size"]}


def tokenizer_identity(record: dict) -> dict:
    """The part of a tokenizer record that decides the tokens: where a given file was read from does not."""
    return {key: value for key, value in record.items() if key != "path"}


def scan_tokens(path: Path, dtype: np.dtype, vocab_size: int) -> tuple[str, tuple[int, int] | None]:
    """sha256 of a token file and its first id outside the vocab as (position, id), or None, in one read of the
    file: the id check costs a max over each chunk already in memory, not another pass over the data."""
    digest = hashlib.sha256()
    outside, position = None, 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype)
            if outside is None and int(ids.max()) >= vocab_size:
                first = int(np.argmax(ids >= vocab_size))
                outside = (position + first, int(ids[first]))
            position += len(ids)
    return digest.hexdigest(), outside


def verify_dataset(dataset_dir: Path, check_checksums: bool = True) -> dict:
    """Return the manifest after checking file sizes (cheap) and, optionally, sha256 checksums and that every
    token id is below vocab_size (the same read)."""
    dataset_dir = Path(dataset_dir)
    manifest = read_manifest(dataset_dir)
    dtype = np.dtype(manifest["dtype"])
    for split in SPLITS:
        path = split_path(dataset_dir, split)
        expected = manifest["tokens"][split] * dtype.itemsize
        actual = path.stat().st_size if path.is_file() else None
        if actual != expected:
            raise DatasetCorruptError(
                f"{path}: size {actual} bytes, manifest says {expected}; delete {dataset_dir} to rebuild it"
            )
    if not check_checksums:
        return manifest
    tokenizer_path = dataset_dir / TOKENIZER_NAME
    if not tokenizer_path.is_file() or sha256_file(tokenizer_path) != manifest["sha256"][TOKENIZER_NAME]:
        raise _checksum_mismatch(tokenizer_path)
    for split in SPLITS:
        path = split_path(dataset_dir, split)
        checksum, outside = scan_tokens(path, dtype, manifest["vocab_size"])
        if checksum != manifest["sha256"][path.name]:
            raise _checksum_mismatch(path)
        if outside is not None:
            raise DatasetCorruptError(f"{path}: token {outside[0]} is id {outside[1]}, not below vocab_size="
                                      f"{manifest['vocab_size']} in {MANIFEST_NAME}; delete {dataset_dir} to rebuild it")
    return manifest


def _checksum_mismatch(path: Path) -> DatasetCorruptError:
    return DatasetCorruptError(f"{path}: sha256 does not match {MANIFEST_NAME}; delete {path.parent} to rebuild it")
