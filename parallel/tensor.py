"""Tensor + sequence parallelism (Megatron style) on plain tensors.

Within a tp group every rank holds the residual stream of T/tp tokens (sequence parallel): the
embedding, the norms, the depth reads and every stored block representation b_n are local to the
rank's slice of the sequence, so each rank stores N*T/tp*d block elements. The token mixers and the
dense MLP are the tensor-parallel regions: their input is all-gathered along the sequence, they run
on H/tp heads (inter/tp channels) with column-parallel input projections and a row-parallel output
projection, and their partial output is reduce-scattered back onto the sequence slices, where the
depth merge and the partial-sum update are local. The MoE runs on the rank's own tokens, whole: its
router, experts, shared experts and LatentMoE's latent projections are replicated over tp.

Parameters stay plain tensors. A sharded one holds its slice (its heads); a replicated one holds a
full copy whose gradient is a partial sum over the group (each rank saw other tokens or other heads),
which `reduce_replicated_grads` completes. Where a parameter is split is recorded beside it
(parallel/placement.py). The collectives are torch's autograd-aware
functional collectives: gather forward = reduce-scatter backward and vice versa.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.distributed.tensor import DTensor

from model.decoder import Decoder
from model.kda import KimiDeltaAttention
from model.mla import MultiHeadLatentAttention
from model.mlp import GatedMLP
from model.moe import MoE
from parallel.compat import all_gather_autograd, reduce_scatter_autograd
from parallel.dims import Layout
from parallel.placement import place, placed_parameters


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/tp, ...) -> (B, T, ...); backward reduce-scatters the gradient."""
    return all_gather_autograd(x.contiguous(), 1, group)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums (B, T, ...) -> this rank's summed slice (B, T/tp, ...); backward all-gathers."""
    return reduce_scatter_autograd(x.contiguous(), "sum", 1, group)


def local_sequence(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's slice of the sequence dimension (dim 1) of a full-sequence tensor: context parallelism's
    slice (parallel/context.py), cut again by tp (the tp regions gather the tp slices back into it)."""
    pieces = layout.degrees.sequence_ranks
    return x.chunk(pieces, dim=1)[layout.cp_rank * layout.tp + layout.tp_rank] if pieces > 1 else x


def _region(module: nn.Module, group) -> None:
    """Make `module` a tensor-parallel region: full sequence in, reduce-scattered partial output out."""
    module.register_forward_pre_hook(lambda _, args: (gather_sequence(args[0], group), *args[1:]))
    module.register_forward_hook(lambda _, args, output: scatter_sequence(output, group))


# What tp splits, per module kind: the path of each split weight in the module and the dim it is split along.
# 0: output features, by head or channel (column-parallel, a bias split with them); 1: input features
# (row-parallel). KDA's q/k/v, beta, the decay's second projection, the output gate's last one (g_proj.1
# of the low-rank gate, g_proj of the full-rank one), depthwise convs and per-channel decay parameters are
# head-major. MLA's kv latent (kv_a_proj, kv_a_norm) and query latent (q_a_proj, q_a_layernorm) are shared by
# all heads and stay replicated; its queries (q_proj or q_b_proj) and output gate (g_proj) are head-major.
# A path the module's options leave without a weight (q_proj under a query LoRA, g_proj.1 of a full-rank
# gate, the low-rank gate's g_proj container) is skipped. `apply_tensor_parallel` splits these and the
# memory planner counts them.
TP_SPLITS: dict[type[nn.Module], dict[str, int]] = {
    KimiDeltaAttention: {"q_proj": 0, "k_proj": 0, "v_proj": 0, "b_proj": 0, "f_proj.1": 0, "g_proj.1": 0,
                         "g_proj": 0, "q_conv1d": 0, "k_conv1d": 0, "v_conv1d": 0, "A_log": 0, "dt_bias": 0,
                         "o_proj": 1},
    MultiHeadLatentAttention: {"q_proj": 0, "q_b_proj": 0, "kv_b_proj": 0, "g_proj": 0, "o_proj": 1},
    GatedMLP: {"gate_proj": 0, "up_proj": 0, "down_proj": 1},
}


def _split_part(module: nn.Module, path: str) -> nn.Parameter | nn.Module | None:
    """The parameter, or the Linear or depthwise Conv1d, at `path` in `module`; None where this module's
    options give it no such weight."""
    if isinstance(getattr(module, path, None), nn.Parameter):
        return getattr(module, path)
    try:
        part = module.get_submodule(path)
    except AttributeError:
        return None
    return part if isinstance(part, (nn.Linear, nn.Conv1d)) else None


def _split_parameters(module: nn.Module) -> list[tuple[nn.Module, str, str, int]]:
    """(owner, parameter name, its path in `module`, dim) of every parameter TP_SPLITS splits in `module`;
    none for a module kind tp leaves whole (the MoE)."""
    splits = next((s for kind, s in TP_SPLITS.items() if isinstance(module, kind)), {})
    out = []
    for path, dim in splits.items():
        part = _split_part(module, path)
        if part is None:
            continue
        if isinstance(part, nn.Parameter):
            out.append((module, path, path, dim))
            continue
        if dim == 1 and part.bias is not None:
            raise ValueError(f"{path}.bias: a row-parallel linear with a bias would add it tp times")
        out.append((part, "weight", f"{path}.weight", dim))
        if dim == 0 and part.bias is not None:
            out.append((part, "bias", f"{path}.bias", dim))
    return out


def tp_split_names(model: Decoder) -> frozenset[str]:
    """The names of the parameters `apply_tensor_parallel` splits."""
    return frozenset(f"layers.{key}.{sublayer}.{path}" for key, block in model.layers.items()
                     for sublayer in ("attn", "mlp") for _, _, path, _ in _split_parameters(getattr(block, sublayer)))


def _shard(module: nn.Module, prefix: str, rank: int, tp: int) -> None:
    """Keep this rank's slice of every parameter TP_SPLITS splits in `module`; a split Linear or depthwise
    conv takes its new feature or channel count."""
    for owner, name, path, dim in _split_parameters(module):
        place(owner, prefix + path.removesuffix(name), name, dim, "tp", rank, tp)
        if isinstance(owner, nn.Linear):
            owner.out_features, owner.in_features = owner.weight.shape
        elif isinstance(owner, nn.Conv1d):  # depthwise: one filter per channel
            owner.in_channels = owner.out_channels = owner.groups = owner.weight.shape[0]


class SequenceTotals:
    """Replaces MoE.sequence_totals when ranks hold slices of every sequence (tp's sequence parallelism, cp):
    the sequence-level balance loss sums its per-sequence counts and probabilities over those ranks. The
    probabilities' sum is autograd-aware (its backward sums the gradients too), so every rank's tokens get
    the whole loss's gradient; the replicated router's gradient is then summed as usual."""

    def __init__(self, groups: list, ranks: int):
        self.groups, self.ranks = groups, ranks

    def __call__(self, routed: torch.Tensor, prob_sums: torch.Tensor, tokens: int):
        routed = routed.clone()
        for group in self.groups:
            dist.all_reduce(routed, group=group)
            prob_sums = dist_nn.all_reduce(prob_sums, group=group)
        return routed, prob_sums, tokens * self.ranks


def total_balance_over_sequence(model: Decoder, layout: Layout) -> None:
    """Under tp or cp, total every MoE layer's sequence-level balance loss over the ranks of a sequence."""
    groups = [group for group, size in ((layout.tp_group, layout.tp), (layout.cp_group, layout.cp)) if size > 1]
    if groups:
        for moe in model.moe_layers():
            moe.sequence_totals = SequenceTotals(groups, layout.degrees.sequence_ranks)


def apply_tensor_parallel(model: Decoder, layout: Layout) -> None:
    """Split the token mixers and dense MLPs of `model` (in place) over the tp group; the MoE layers keep
    their experts (total_balance_over_sequence sums their balance loss over the group)."""
    if layout.tp == 1:
        return
    rank, tp, group = layout.tp_rank, layout.tp, layout.tp_group
    for key, block in model.layers.items():
        prefix = f"layers.{key}."
        _shard(block.attn, prefix + "attn.", rank, tp)
        block.attn.n_heads //= tp
        _region(block.attn, group)
        if isinstance(block.mlp, GatedMLP):
            _shard(block.mlp, prefix + "mlp.", rank, tp)
            _region(block.mlp, group)


def reduce_replicated_grads(model: nn.Module, group) -> None:
    """Sum over the tp group the gradients of every parameter not split by tp (coalesced). Under fsdp x tp
    a gradient is FSDP's DTensor shard: the tp peers hold the same chunk of a replicated parameter (the
    same fsdp index), so their local shards are summed."""
    if group is None or dist.get_world_size(group) == 1:
        return
    params = [p for _, p, placement in placed_parameters(model) if placement is None or placement.axis != "tp"]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(chunk.view_as(grad))
