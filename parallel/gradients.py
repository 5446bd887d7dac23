"""Gradients and MoE balancing across the layout's ranks, after a backward: completing tp's partial sums
and averaging over data, cp and same-expert ranks (`finish_gradients`), the whole model's norm and clipping
(`clip_grad_norm`), and the expert load every rank's balancing bias follows (`sync_moe_load`)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from model.decoder import Decoder
from parallel.dims import Layout
from parallel.expert import expert_param_names
from parallel.placement import placed_parameters
from parallel.tensor import reduce_replicated_grads


def all_reduce(value: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=op, group=group)
    return value


def finish_gradients(model: Decoder, layout: Layout, dp_averaged: bool) -> None:
    """After backward: complete the partial sums over tp, then average over the data-parallel and cp ranks
    (over dp_cp for shared parameters unless DDP or FSDP already did, over the same-expert ranks for experts:
    under ep an expert's gradient already sums its ep group's tokens)."""
    reduce_replicated_grads(model, layout.tp_group)
    experts = set(expert_param_names(model))
    for name, p in model.named_parameters():
        if name in experts:
            if p.grad is None:  # no token reached this rank's experts; its peers still reduce
                p.grad = torch.zeros_like(p)
            all_reduce(p.grad, layout.expert_dp_group).div_(layout.dp_cp)
        elif p.grad is not None and not dp_averaged and layout.dp_cp > 1:
            all_reduce(p.grad, layout.dp_cp_group).div_(layout.dp_cp)


def clip_grad_norm(model: Decoder, max_norm: float, layout: Layout) -> float:
    """Norm of the whole model's gradient, then clip to max_norm (0: measure only, as Megatron's
    clip_grad=0): slices are summed over the group that splits them (tp or ep; a DTensor's over the
    mesh dimensions it is sharded along, not those it is replicated over), and the stages' disjoint
    parameters over the pipeline group."""
    device = next(model.parameters()).device
    squares = {kind: torch.zeros((), device=device) for kind in ("tp", "ep", None)}
    dtensor_groups = {}  # kind -> the groups its squares are summed over
    grads = []
    for _, p, placement in placed_parameters(model):
        if p.grad is None:
            continue
        grads.append(p.grad)
        grad, kind = p.grad.detach(), placement.axis if placement is not None else None
        if isinstance(grad, DTensor):  # FSDP's shard: of a tp slice too under fsdp x tp
            mesh = grad.device_mesh
            sharded = [i for i, spec in enumerate(grad.placements) if spec.is_shard()]
            tp_slice = kind == "tp"
            kind = tuple(mesh.mesh_dim_names[i] for i in sharded) + (("tp",) if tp_slice else ())
            dtensor_groups.setdefault(kind, [mesh.get_group(i) for i in sharded] + ([layout.tp_group] if tp_slice else []))
            grad = grad.to_local()
        squares[kind] = squares.get(kind, torch.zeros((), device=device)) + grad.float().pow(2).sum()
    local = (squares.pop(None) + all_reduce(squares.pop("tp"), layout.tp_group)
             + all_reduce(squares.pop("ep"), layout.ep_group))
    for kind, value in squares.items():
        for group in dtensor_groups[kind]:
            value = all_reduce(value, group)
        local = local + value
    norm = math.sqrt(all_reduce(local, layout.pp_group).item())
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def moe_load_imbalance(model: Decoder, layout: Layout) -> float:
    """Mean max/mean expert load over every MoE layer of the model (1.0: none). A pipeline rank holds only
    its stages' layers, so the sums go over the pipeline group; call after sync_moe_load."""
    layers = model.moe_layers()
    device = layers[0].load_counts.device if layers else torch.device("cpu")
    totals = torch.tensor([sum(moe.load_imbalance() for moe in layers), len(layers)], dtype=torch.float64,
                          device=device)
    all_reduce(totals, layout.pp_group)
    return (totals[0] / totals[1]).item() if totals[1] else 1.0


@torch.no_grad()
def sync_moe_load(model: Decoder, layout: Layout) -> None:
    """Sum expert load over the ranks that routed different tokens (dp, which counts the fsdp shards,
    and cp's and tp's sequence slices) so every rank nudges its balancing bias the same way."""
    for moe in model.moe_layers():
        all_reduce(all_reduce(moe.load_counts, layout.dp_cp_group), layout.tp_group)
