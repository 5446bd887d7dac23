"""Context parallelism: the cp ranks of a group hold contiguous slices of the same sequences.

Rank r of cp holds tokens [r T/cp, (r+1) T/cp) of every sequence. The embedding, norms, MLPs, MoE and the
AttnRes depth reads mix within a token, and every stored block representation b_n stays on the rank of its
tokens (N * T/cp * d elements per rank, as under sequence parallelism). Only the token mixers reach across
slices, through the `SequenceSplit` seam (model/sequence_split.py) that `ContextSplit` fills:
- KDA's short convolution takes the previous slice's last conv_kernel - 1 inputs;
- KDA's recurrence passes state, exactly and with no cap at the head count (Megatron's gated-delta-net
  all-to-all is capped there): each rank runs its slice from zero and from the identity
  (kda_chunk_from_unknown_start), the ranks all-gather (final state, transition), and each chains the
  earlier ones in fp32 into its true start state and corrects its outputs by it;
- MLA all-gathers the normalised kv latent plus the shared key slice (kv_lora_rank + qk_rope_head_dim per
  token, small next to full keys and values) and attends over slices 0..r with the causal mask on global
  positions. The split is contiguous, not zigzag: rank r scores (r+1)/cp of the keys (docs/TRAINING.md).

The all-gathers are torch's autograd-aware functional collectives, so the backward pass is exact too: a
gather's backward reduce-scatters the gradients of what the later ranks read. That backward is a collective,
so every rank's result depends on every gather, by a zero term where the rank reads nothing (rank 0).
A parameter's gradient from the rank's own tokens is part of the sum over the cp ranks, which the data
parallelism's averaging over `dp_cp_group` completes (the loss is each rank's mean over its tokens).
"""
from __future__ import annotations

import torch
from torch.distributed import _functional_collectives as funcol

from model.decoder import Decoder
from model.kda import KimiDeltaAttention
from model.mla import MultiHeadLatentAttention
from parallel.dims import Layout


class ContextSplit:
    """The SequenceSplit of one cp group: this rank holds slice `rank` of `size`."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """(...) -> (size, ...): every rank's x, in slice order."""
        return funcol.all_gather_single_autograd(x.unsqueeze(0).contiguous(), 0, self.group)

    def previous_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        tails = self._gather(x[:, x.shape[1] - n:])  # (size, B, n, D)
        if self.rank == 0:
            return tails[0] * 0  # the sequence's start: zero history, still on the gather's backward
        return tails[self.rank - 1]

    def through_mine(self, x: torch.Tensor) -> torch.Tensor:
        slices = self._gather(x)[:self.rank + 1]  # (rank+1, B, T, D)
        return torch.cat(slices.unbind(0), dim=1)  # (B, (rank+1) T, D)

    def start_state(self, final: torch.Tensor, transition: torch.Tensor) -> torch.Tensor:
        V = final.shape[-1]
        pieces = self._gather(torch.cat([final.float(), transition.float()], dim=-1))  # (size, B, H, K, V+K)
        start = final.new_zeros(final.shape, dtype=torch.float32) + pieces.sum() * 0  # slice 0 starts at zero
        for earlier_final, earlier_transition in (p.split([V, p.shape[-1] - V], dim=-1) for p in pieces[:self.rank]):
            start = earlier_transition @ start + earlier_final  # (B, H, K, V)
        return start


def apply_context_parallel(model: Decoder, layout: Layout) -> None:
    """Give every token mixer of `model` this rank's ContextSplit."""
    if layout.cp == 1:
        return
    split = ContextSplit(layout.cp_group, layout.cp_rank, layout.cp)
    for module in model.modules():
        if isinstance(module, (KimiDeltaAttention, MultiHeadLatentAttention)):
            module.sequence_split = split

