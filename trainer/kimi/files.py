"""A release directory's safetensors, read tensor by tensor and memory-mapped: through
model.safetensors.index.json when the weights are sharded, else model.safetensors. `tensor(name)` reads one
whole tensor, `slice(name, index)` only the rows a rank owns (safe_open's get_slice reads no more than it
returns). K3's routed experts ship as MXFP4 (compressed-tensors, `weight_packed` + `weight_scale`); `weight`
dequantises them through the compressed-tensors library, never a decoder of our own.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PACKED, SCALE = "weight_packed", "weight_scale"


class ReleaseFilesError(ValueError):
    """Unreadable or inconsistent release weights; the message is one line."""


def _one_line(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


class ReleaseFiles:
    def __init__(self, directory: Path, quantization: dict | None = None):
        self.directory = directory
        self.quantization = quantization
        self.file_of = self._weight_map()

    def _weight_map(self) -> dict[str, Path]:
        index = self.directory / INDEX_FILE
        if not index.is_file():
            single = self.directory / SINGLE_FILE
            if not single.is_file():
                raise ReleaseFilesError(f"{self.directory} has neither {INDEX_FILE} nor {SINGLE_FILE}")
            return {name: single for name in self._in_file(single, lambda handle: handle.keys())}
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ReleaseFilesError(f"{index} could not be read ({_one_line(error)})") from None
        files = {}
        for name, file in weight_map.items():
            path = self.directory / file
            if not isinstance(file, str) or Path(file).name != file or not path.is_file():
                raise ReleaseFilesError(f"{index} maps {name} to {file!r}, not a file of {self.directory}")
            files[name] = path
        return files

    def _in_file(self, file: Path, work):
        """work(the open safetensors file), the file opened for this read only (a mapping left open would keep
        every page read in the process's resident memory); an unreadable file is one line naming it."""
        try:
            with safe_open(file, "pt") as handle:
                return work(handle)
        except (OSError, SafetensorError) as error:
            raise ReleaseFilesError(f"{file} could not be read ({_one_line(error)})") from None

    def _with(self, name: str, work):
        if name not in self.file_of:
            raise ReleaseFilesError(f"{self.directory} has no tensor {name}")
        return self._in_file(self.file_of[name], work)

    def names(self) -> set[str]:
        return set(self.file_of)

    def shape(self, name: str) -> list[int]:
        return self._with(name, lambda handle: handle.get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self._with(name, lambda handle: handle.get_tensor(name))

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Only `index` of the tensor `name` (a rank's rows or columns), read from the memory map."""
        return self._with(name, lambda handle: handle.get_slice(name)[index])

    def quantized(self, name: str) -> bool:
        """Whether the Linear weight `name` (ending in .weight) is stored packed, as K3's routed experts are:
        read from the index, not the quantisation config's target regexes (those also match tensors every
        engine loads plain)."""
        return name not in self.file_of and name.removesuffix("weight") + PACKED in self.file_of

    def weight(self, name: str) -> torch.Tensor:
        """The tensor `name`; a packed Linear weight dequantised (compressed-tensors) to bfloat16."""
        if not self.quantized(name):
            return self.tensor(name)
        stem = name.removesuffix("weight")
        from trainer.kimi.quantized import dequantise

        return dequantise({PACKED: self.tensor(stem + PACKED), SCALE: self.tensor(stem + SCALE)},
                          self.quantization, f"{self.directory}: {stem}")

    def stored_names(self, name: str) -> list[str]:
        """The names in the files that hold the weight `name` (its packed pair when quantized)."""
        stem = name.removesuffix("weight")
        return [stem + PACKED, stem + SCALE] if self.quantized(name) else [name]
