"""The whole model's weights on global rank 0, gathered from any layout, for work that needs one process's model
while the others wait (train.eval_tasks, trainer/downstream.py).

Each rank's entries are made whole where they are split, one at a time: FSDP's shards and the tp/ep slices
(shown as DTensors of the whole parameter by parallel/state_dict.py) are all-gathered within their groups.
Only the ranks of rank 0's pipeline group keep them (on the host); under pp each of them then broadcasts its
stages' entries over that group, names first, so rank 0 holds them all. Nothing goes through pickle: names
travel as UTF-8 bytes, tensors as tensors. Rank 0's host memory holds the whole model once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from parallel.dims import Layout
from parallel.state_dict import to_global_state


def whole_state_dict(model: nn.Module, layout: Layout, shapes: dict[str, torch.Tensor],
                     device: torch.device) -> dict[str, torch.Tensor] | None:
    """`model`'s state dict under its single-process names, every entry whole, on global rank 0 (None on the
    other ranks). `shapes`: the whole model's state dict on the meta device (its names, shapes and dtypes).
    Collective: every rank calls it."""
    state = to_global_state({"model": get_model_state_dict(model)}, model, layout.mesh)["model"]
    # The pipeline group of rank 0: the ranks at index 0 of every other mesh dimension.
    keeps = (layout.data_rank, layout.tp_rank, layout.cp_rank, layout.ep_rank) == (0, 0, 0, 0)
    local = {}
    for name, value in sorted(state.items()):  # sorted: the ranks of one group gather in the same order
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        if keeps:
            local[name] = whole.detach().cpu()
    if keeps and layout.pp > 1:
        local = _pipeline_entries(local, layout, shapes, device)
    return local if dist.get_rank() == 0 else None


def _pipeline_entries(local: dict, layout: Layout, shapes: dict, device: torch.device) -> dict:
    """Every pp rank's entries broadcast over the pp group in turn (through `device`, which the backend
    sends from); pp rank 0 keeps them all."""
    group = layout.pp_group
    for source in range(1, layout.pp):
        sending, root = layout.pp_rank == source, dist.get_global_rank(group, source)
        names = _broadcast_names(list(local) if sending else None, root, group, device)
        for name in names:
            tensor = (local[name].to(device) if sending
                      else torch.empty(shapes[name].shape, dtype=shapes[name].dtype, device=device))
            dist.broadcast(tensor, src=root, group=group)
            if layout.pp_rank == 0:
                local[name] = tensor.cpu()
    return local


def _broadcast_names(names: list[str] | None, root: int, group, device: torch.device) -> list[str]:
    """`names` from global rank `root` to every rank of `group`, as its length then its UTF-8 bytes."""
    encoded = "\n".join(names).encode() if names is not None else b""
    length = torch.tensor([len(encoded)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=root, group=group)
    data = (torch.tensor(list(encoded), dtype=torch.uint8, device=device) if names is not None
            else torch.empty(int(length.item()), dtype=torch.uint8, device=device))
    dist.broadcast(data, src=root, group=group)
    return bytes(data.cpu().tolist()).decode().split("\n") if length.item() else []
