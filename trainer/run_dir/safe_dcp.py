"""DCP loading that never unpickles arbitrary objects.

torch.distributed.checkpoint (torch 2.13) unpickles in two places when it loads: FileSystemReader.read_metadata
runs pickle.load on `.metadata`, and DefaultLoadPlanner.load_bytes runs torch.load(weights_only=False) on every
non-tensor entry (optimizer param-group values, the LR scheduler's state). Either would run code planted in a
checkpoint. SafeFileSystemReader unpickles `.metadata` with a find_class allowlist of exactly the classes a DCP
metadata file holds; WeightsOnlyLoadPlanner loads the non-tensor entries with torch.load(weights_only=True).
Tensors themselves DCP already reads with weights_only=True.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

# Every global a DCP .metadata pickle refers to, found with pickletools on checkpoints of every layout
# (single process, DDP, pp, tp/ep DTensors): the metadata dataclasses and the memory-format enum, the
# storage record, torch.Size, the checkpoint_id path, and layouts and dtypes (the two ways torch pickles them).
_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
})


class UnsafeCheckpointData(ValueError):
    """A checkpoint file asks the unpickler for something our checkpoints never hold; the message is one line."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpointData(f"{module}.{name} is not allowed in DCP metadata (refusing to unpickle it)")


def load_dcp_metadata(stream) -> Metadata:
    """A DCP .metadata file, unpickled with the allowlist; a planted object raises UnsafeCheckpointData."""
    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointData(f"holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose read_metadata uses the allowlist unpickler (the rest is FileSystemReader's)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # kwargs["rank"] asks for the per-rank `__<rank>.metadata` DCP falls back to; we never write those,
        # so it is missing, as in FileSystemReader.
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = load_dcp_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose load_bytes (otherwise the same) uses torch.load(weights_only=True): the
    non-tensor entries we save are plain ints, floats, bools, strings, None and lists/tuples/dicts of them."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            first = str(error).splitlines()[0] if str(error) else ""
            raise UnsafeCheckpointData(f"entry {fqn} is not a plain value ({first})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
