"""Initial weights of a model each rank holds only part of, from an unsliced meta template.

Every rank materialises the template one init unit at a time on the host (model.init.materialise draws
each unit from its own seed) and keeps only its own part of each full parameter, so it holds its parts
plus one unit, and its weights are exactly those one process has for the same seed.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from model.init import materialise


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
