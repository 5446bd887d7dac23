"""Initial weights of a model each rank holds only part of, from an unsliced meta template.

Every rank materialises the template one init unit at a time on the host (model.init.materialise draws
each unit from its own seed) and keeps only its own part of each full parameter, so it holds its parts
plus one unit, and its weights are exactly those one process has for the same seed. Or, from weights
stored elsewhere (a Kimi release, trainer/kimi/), each rank reads only the part it holds: fill_held_regions.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from model.init import materialise
from parallel.placement import placed_parameters


def fill_local_parts(model: nn.Module, template: nn.Module, seed: int, slice_of=None) -> None:
    """Initialise a sliced or fully_shard-ed model allocated with to_empty from `template`, an unsliced meta copy:
    the template is materialised on the host one init unit at a time (model.init.materialise), and
    each full parameter leaves only this rank's part behind (its tp/ep slice, or FSDP's shard of that), so a
    rank holds its parts plus one unit
    and starts from exactly the weights one process has for the same seed. A plain parameter (no FSDP,
    or one FSDP left out) takes `slice_of(name, full)` (its tp/ep slice), or the full tensor without one;
    an FSDP shard is this rank's chunk of that slice (fsdp x tp)."""
    params = dict(model.named_parameters())

    def keep_local_part(name: str, full: torch.Tensor) -> torch.Tensor:
        param = params[name]
        shard = slice_of(name, full) if slice_of is not None else full  # the tp/ep slice FSDP then shards
        # Every rank computes the same full tensor, so each takes its own chunk without communication.
        if isinstance(param, DTensor):
            shard = distribute_tensor(shard.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        with torch.no_grad():
            param.copy_(shard)  # same placements: a local copy
        return torch.empty_like(full, device="meta")

    materialise(template, "cpu", template.cfg.init_stds, seed, place=keep_local_part)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, buffer in template.named_buffers():  # not sharded: each rank holds them whole
            buffers[name].copy_(buffer)


def held_region(param: torch.Tensor, placement) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """(the whole parameter's shape, the index of the part this rank holds): its tp/ep chunk (`placement`, or
    None), and of that FSDP's shard when `param` is a DTensor (torch.chunk's rows along each Shard, as DTensor
    splits them)."""
    shape = list(param.shape)  # a DTensor's is its global one: the tp/ep chunk FSDP sharded
    whole = placement.whole_shape(shape) if placement is not None else list(shape)
    starts = [0] * len(shape)
    if placement is not None:
        starts[placement.dim] = placement.rank * shape[placement.dim]
    if isinstance(param, DTensor):
        coordinate = param.device_mesh.get_coordinate()
        for mesh_dim, spec in enumerate(param.placements):
            if spec.is_shard():
                chunk = -(-shape[spec.dim] // param.device_mesh.size(mesh_dim))
                begin = min(coordinate[mesh_dim] * chunk, shape[spec.dim])
                starts[spec.dim] += begin
                shape[spec.dim] = min(chunk, shape[spec.dim] - begin)
        if tuple(shape) != tuple(param.to_local().shape):
            raise ValueError(f"a DTensor sharded as {param.placements} holds {tuple(param.to_local().shape)}, "
                             f"not the chunk {tuple(shape)} torch.chunk gives")
    return tuple(whole), tuple(slice(start, start + size) for start, size in zip(starts, shape))


@torch.no_grad()
def fill_held_regions(model: nn.Module, names: set[str], read) -> None:
    """Give the parameters and buffers `names` of a model each rank holds part of (sliced for tp/ep, sharded by
    FSDP, a pipeline stage's blocks: whatever the layout left on this rank) the values `read(name, whole_shape,
    index)` returns for the part this rank holds, so a rank reads only its own slices of a source it can
    index (memory-mapped safetensors). `read` may return None to leave a tensor as it is. Buffers are whole
    on every rank."""
    for name, param, placement in placed_parameters(model):
        if name in names:
            whole, index = held_region(param, placement)
            value = read(name, whole, index)
            if value is not None:
                (param.to_local() if isinstance(param, DTensor) else param).copy_(value)
    for name, buffer in model.named_buffers():
        if name in names:
            value = read(name, tuple(buffer.shape), tuple(slice(0, size) for size in buffer.shape))
            if value is not None:
                buffer.copy_(value)
