"""A Megatron .idx file (megatron-core's index of an indexed dataset) checked against its .bin before
megatron-core opens it: megatron-core trusts every number in it, so a negative length or a pointer past the
end reads other data, a huge count fails deep inside numpy, and a document index out of range fails mid-run.

Layout (megatron-core's IndexedDatasetBuilder): the 9-byte magic, version 1 (<Q), the token dtype's code
(<B), the sequence count S (<Q) and the document-index length D + 1 (<Q), then S int32 lengths, S int64
byte pointers into the .bin and D + 1 int64 document boundaries (sequence numbers from 0 to S).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")
# megatron-core's DType codes of the integer token dtypes.
TOKEN_DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}


class SequenceIndexError(ValueError):
    """Why an .idx file cannot be used (the caller names the file and the remedy)."""


@dataclass(frozen=True)
class SequenceIndex:
    dtype: str
    sequences: int
    documents: int
    tokens: int


def read_sequence_index(idx_path: Path, bin_bytes: int) -> SequenceIndex:
    """The counts of an .idx file whose every number is consistent with itself and with a .bin of bin_bytes:
    lengths >= 0, pointers contiguous from 0, the lengths summing to the .bin's items, document boundaries
    from 0 to S and never decreasing. One read of the .idx (about 20 bytes a sequence)."""
    with open(idx_path, "rb") as f:
        data = f.read()
    if len(data) < HEADER.size:
        raise SequenceIndexError(f"{len(data)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, code, sequences, boundaries = HEADER.unpack_from(data)
    if magic != MAGIC or version != 1:
        raise SequenceIndexError(f"not a version-1 Megatron index (magic {magic!r}, version {version})")
    if code not in TOKEN_DTYPE_CODES:
        raise SequenceIndexError(f"token dtype code {code} is none of megatron-core's integer dtypes "
                                 f"{sorted(TOKEN_DTYPE_CODES)}")
    expected = HEADER.size + 12 * sequences + 8 * boundaries
    if len(data) != expected:
        raise SequenceIndexError(f"{len(data)} bytes, but its counts ({sequences} sequences, {boundaries} document "
                                 f"boundaries) make {expected}")
    dtype = np.dtype(TOKEN_DTYPE_CODES[code])
    lengths = np.frombuffer(data, np.int32, sequences, HEADER.size).astype(np.int64)
    pointers = np.frombuffer(data, np.int64, sequences, HEADER.size + 4 * sequences)
    bounds = np.frombuffer(data, np.int64, boundaries, HEADER.size + 12 * sequences)
    if (lengths < 0).any():
        at = int(np.argmax(lengths < 0))
        raise SequenceIndexError(f"sequence {at} has length {int(lengths[at])}")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * dtype.itemsize if sequences else lengths
    if (pointers != starts).any():
        at = int(np.argmax(pointers != starts))
        raise SequenceIndexError(f"sequence {at} starts at byte {int(pointers[at])}, not {int(starts[at])} where "
                                 "the sequences before it end")
    tokens = int(lengths.sum())
    if tokens * dtype.itemsize != bin_bytes:
        raise SequenceIndexError(f"its lengths sum to {tokens} {dtype} tokens, but the .bin holds {bin_bytes} bytes")
    if boundaries < 1 or bounds[0] != 0 or bounds[-1] != sequences or (np.diff(bounds) < 0).any():
        raise SequenceIndexError(f"its document boundaries do not rise from 0 to its {sequences} sequences")
    return SequenceIndex(dtype.name, sequences, boundaries - 1, tokens)
