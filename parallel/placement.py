"""Where a parameter is split across ranks: a `Placement` kept beside the tensor, on the module holding it.

Tensor and expert parallelism replace a parameter by this rank's chunk of it along one dimension (its
heads, channels or experts), as a plain tensor. `place` does that and records `Placement(dim, axis)` under
the parameter's name in its module. Gradient completion, clipping, init filling, Muon and the checkpoint
conversion (parallel/state_dict.py) read it back with `placement_of` or `placed_parameters`.

The record lives on the module, not on the Parameter object, because the object does not survive:
`to_empty`, FSDP2's `fully_shard` and materialising on the device each put a new Parameter in the
module's slot under the same name.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

AXES = ("tp", "ep")
_RECORD = "_parallel_placements"  # module attribute: parameter name -> Placement


@dataclass(frozen=True)
class Placement:
    """This rank holds chunk `rank` of `size` along `dim`, split over the layout's `axis` ("tp" or "ep")."""
    dim: int
    axis: str
    rank: int
    size: int

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of `full`, the whole parameter."""
        return full.chunk(self.size, self.dim)[self.rank]

    def whole_shape(self, local_shape: torch.Size) -> list[int]:
        shape = list(local_shape)
        shape[self.dim] *= self.size
        return shape


def place(module: nn.Module, prefix: str, name: str, dim: int, axis: str, rank: int, size: int) -> None:
    """Replace module.<name> by this rank's chunk along `dim` of `size` (over `axis`) and record where it is
    split. `prefix` (the module's name in the model) only names the parameter in the error."""
    param = getattr(module, name)
    if param.shape[dim] % size:
        raise ValueError(f"{prefix}{name} has {param.shape[dim]} rows along dim {dim}, not divisible by {axis}={size}")
    placement = Placement(dim, axis, rank, size)
    setattr(module, name, nn.Parameter(placement.local(param.detach()).clone()))
    module.__dict__.setdefault(_RECORD, {})[name] = placement


def placement_of(model: nn.Module, name: str) -> Placement | None:
    """The placement of parameter `name` of `model` (None: every rank holds all of it)."""
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
    return module.__dict__.get(_RECORD, {}).get(leaf)


def placed_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, Placement | None]]:
    """Every parameter of `model`, as named_parameters names them (each once), with its placement or None."""
    seen = set()
    for module_name, module in model.named_modules():
        record = module.__dict__.get(_RECORD, {})
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield f"{module_name}.{leaf}" if module_name else leaf, param, record.get(leaf)


def names_on(model: nn.Module, axis: str) -> list[str]:
    """The names of the parameters split over `axis`."""
    return [name for name, _, placement in placed_parameters(model) if placement is not None and placement.axis == axis]
