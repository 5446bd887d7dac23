"""Checkpoint states that load into any tp/ep layout: this rank's slices shown to DCP as whole tensors.

`to_global_state` wraps every tp/ep slice of a {"model": ..., "optim": ...} state (parameters and their
optimizer moments, named as get_state_dict names them) as a DTensor of the whole parameter over the
layout's mesh, sharing the slice's storage, so DCP saves whole tensors and loads whichever part a rank
holds. `from_global_state` undoes it after DCP has loaded into them in place.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # private: checked over torch 2.11-2.15

from parallel.placement import Placement, placed_parameters


def _placements(model: nn.Module) -> dict[str, tuple[Placement, nn.Parameter]]:
    return {name: (placement, param) for name, param, placement in placed_parameters(model) if placement is not None}


def _moment_owner(flat_key: str) -> str:
    """The parameter a flattened optimizer entry belongs to: `state.<name>.<moment>` -> name."""
    return flat_key.removeprefix("state.").rsplit(".", 1)[0]


def _map_state(state: dict, convert) -> dict:
    """`convert(name, value)` over the model entries and every optimizer moment of the state, whether
    get_state_dict nested the optimizer state (`state` -> name -> moments) or flattened it."""
    state["model"] = {name: convert(name, value) for name, value in state["model"].items()}
    optim = state.get("optim")
    if optim is not None and isinstance(optim.get("state"), dict):
        optim["state"] = {name: {key: convert(name, value) for key, value in moments.items()}
                          for name, moments in optim["state"].items()}
    elif optim is not None:
        state["optim"] = {key: convert(_moment_owner(key), value) for key, value in optim.items()}
    return state


def to_global_state(state: dict, model: nn.Module, mesh) -> dict:
    """Wrap the tp/ep slices of `state` as DTensors of the whole parameters over `mesh` (the layout's
    DeviceMesh). Under fsdp x tp a slice is FSDP's DTensor shard of it: one DTensor over (fsdp, tp)."""
    placed = _placements(model)
    if not placed:
        return state
    # Slicing a DeviceMesh builds a new one each time (milliseconds at 8 ranks): once per dims a state.
    submesh = functools.cache(lambda *dims: mesh[dims])

    def wrap(name: str, value):
        if name not in placed or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        placement = placed[name][0]
        if isinstance(value, DTensor):
            return _fsdp_and_tp(value, placement, submesh)
        return DTensor.from_local(value, submesh(placement.axis), [Shard(placement.dim)], run_check=False)

    return _map_state(state, wrap)


def from_global_state(state: dict, model: nn.Module) -> dict:
    """Back to this rank's slices after DCP loaded into to_global_state's DTensors: a plain slice for a
    plain parameter, FSDP's own DTensor shard (same storage) under fsdp x tp. FSDP's DTensors of unsplit
    parameters stay as they are for set_state_dict."""
    placed = _placements(model)

    def unwrap(name: str, value):
        if name not in placed or not isinstance(value, DTensor):
            return value
        param = placed[name][1]
        if not isinstance(param, DTensor):
            return value.to_local()
        return DTensor.from_local(value.to_local(), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())

    return _map_state(state, unwrap) if placed else state


def _fsdp_and_tp(shard: DTensor, placement: Placement, submesh) -> DTensor:
    """`shard` (FSDP's, rows of this rank's tp slice) as a DTensor of the whole parameter over the (fsdp, tp)
    mesh, sharing its storage; FSDP's shard dimension is fsdp, or fsdp_cp when it shards over the cp ranks
    too. FSDP cut the tp slice along dim 0: when tp cut dim 0 too, fsdp's chunks lie inside each tp slice
    (tp outer), which DTensor calls a strided shard. `submesh(*dims)` slices the layout's mesh."""
    shape = placement.whole_shape(shard.shape)
    tp = submesh("tp").size()
    fsdp_placement = _StridedShard(0, split_factor=tp) if placement.dim == 0 else Shard(0)
    fsdp_dim = shard.device_mesh.mesh_dim_names[-1]
    return DTensor.from_local(shard.to_local(), submesh(fsdp_dim, "tp"), [fsdp_placement, Shard(placement.dim)],
                              run_check=False, shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
