"""Expert parallelism: the routed experts of every MoE layer split over the ep group.

Each rank of an ep group holds E/ep experts. Routing stays local; the assignments, already sorted
by expert, go to the rank holding their expert with one all-to-all, come back with another, and the
MoE layer combines them as before. The rows are in the experts' width w: d_model, or under LatentMoE the
latent (the MoE projects down before it sorts), so the all-to-alls carry latent_dim elements per row. The
shared expert and LatentMoE's projections stay replicated. The ep group is carved out of
the data-parallel ranks, so the ranks of one ep group see different batches: an expert's gradient
sums its tokens from the whole ep group, and the trainer averages it over `expert_dp_group` (the
ranks holding the same experts) instead of over dp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from model.decoder import Decoder
from model.moe import MoE, grouped_experts
from parallel.dims import Layout
from parallel.placement import names_on, place

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


class ExpertDispatch:
    """Replaces MoE.run_experts: all-to-all the sorted assignments to their experts' ranks and back."""

    def __init__(self, moe: MoE, ep: int, group):
        self.moe, self.ep, self.group = moe, ep, group
        self.local_experts = moe.n_experts // ep

    def __call__(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        P, E_local = self.ep, self.local_experts
        send_splits = counts.view(P, E_local).sum(1)  # (P,) assignments for each rank's experts
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # (P*E_local,) by source, then expert
        recv_counts = recv_counts.view(P, E_local)
        recv_splits = recv_counts.sum(1)  # (P,)
        x_recv = funcol.all_to_all_single_autograd(x_sorted, recv_splits.tolist(), send_splits.tolist(),
                                                   self.group)  # (M, w) by source, then expert

        # Regroup the received rows by local expert (stable, so each expert keeps source order).
        expert_of_row = torch.arange(E_local, device=counts.device).repeat(P).repeat_interleave(recv_counts.flatten())
        order = torch.argsort(expert_of_row, stable=True)  # (M,)
        y_grouped = grouped_experts(x_recv[order], recv_counts.sum(0), self.moe.w_gate, self.moe.w_up,
                                    self.moe.w_down, activation=self.moe.activation)  # (M, w)
        y_recv = y_grouped[torch.argsort(order)]  # (M, w) back in arrival order
        return funcol.all_to_all_single_autograd(y_recv, send_splits.tolist(), recv_splits.tolist(), self.group)


def apply_expert_parallel(model: Decoder, layout: Layout) -> None:
    """Keep this rank's share of every MoE layer's routed experts and route through the ep group."""
    if layout.ep == 1:
        return
    for key, block in model.layers.items():
        if not isinstance(block.mlp, MoE):
            continue
        for name in EXPERT_WEIGHTS:
            place(block.mlp, f"layers.{key}.mlp.", name, 0, "ep", layout.ep_rank, layout.ep)
        block.mlp.run_experts = ExpertDispatch(block.mlp, layout.ep, layout.ep_group)


def expert_param_names(model: Decoder) -> list[str]:
    """The routed experts' parameters this rank holds a share of (none without ep)."""
    return names_on(model, "ep")
