"""A safetensors file written tensor by tensor: the header first (it needs only names, shapes and dtypes), then each
tensor's bytes as it arrives, so a file larger than the host's free memory can be written. The layout is the one
safetensors' own save_file writes: the header's JSON (compact, `__metadata__` first, the tensors in the order of
their data) padded with spaces to 8 bytes, the data ordered by dtype (safetensors' Dtype enum, last first) and then
by name. save_file's metadata order follows a hash map's, so it varies from process to process: only that order
may differ from save_file's output, never the tensors' entries or the data bytes.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

# safetensors' Dtype enum, in its order; save_file writes the data of the later ones first.
DTYPES = (
    (torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"), (torch.float8_e5m2, "F8_E5M2"),
    (torch.float8_e4m3fn, "F8_E4M3"), (torch.int16, "I16"), (torch.uint16, "U16"), (torch.float16, "F16"),
    (torch.bfloat16, "BF16"), (torch.int32, "I32"), (torch.uint32, "U32"), (torch.float32, "F32"),
    (torch.float64, "F64"), (torch.int64, "I64"), (torch.uint64, "U64"),
)
DTYPE_NAMES = dict(DTYPES)
DTYPE_RANK = {dtype: rank for rank, (dtype, _) in enumerate(DTYPES)}


def data_order(specs: dict[str, tuple[torch.Size, torch.dtype]]) -> list[str]:
    """The names in the order save_file lays out their data."""
    return sorted(specs, key=lambda name: (-DTYPE_RANK[specs[name][1]], name))


def header(specs: dict[str, tuple[torch.Size, torch.dtype]], metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length and the padded JSON header of a file holding `specs` (name -> (shape, dtype))."""
    entries, offset = {}, 0
    if metadata is not None:
        entries["__metadata__"] = metadata
    for name in data_order(specs):
        shape, dtype = specs[name]
        size = shape.numel() * dtype.itemsize
        entries[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_streaming(file: Path, specs: dict[str, tuple[torch.Size, torch.dtype]], metadata: dict[str, str] | None,
                    read: Callable[[list[str]], dict[str, torch.Tensor]], batch_bytes: int) -> None:
    """Write `file` with the tensors `specs` describes, asking `read(names)` for them a batch of at most about
    `batch_bytes` at a time (one tensor at least), in data order."""
    order = data_order(specs)
    with open(file, "wb") as out:
        out.write(header(specs, metadata))
        for names in _batches(order, specs, batch_bytes):
            tensors = read(names)
            for name in names:
                tensor = tensors.pop(name)
                if tensor.shape != specs[name][0] or tensor.dtype != specs[name][1]:
                    raise ValueError(f"{name}: read {tuple(tensor.shape)} {tensor.dtype}, the header says "
                                     f"{tuple(specs[name][0])} {specs[name][1]}")
                out.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _batches(order: list[str], specs, batch_bytes: int) -> Iterable[list[str]]:
    batch, size = [], 0
    for name in order:
        shape, dtype = specs[name]
        nbytes = shape.numel() * dtype.itemsize
        if batch and size + nbytes > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += nbytes
    if batch:
        yield batch
