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
  token, small next to full keys and values) and recomputes the keys and values. The slices are contiguous
  (KDA's chain wants them so), but the causal work is balanced: the queries move, with one all-to-all each
  way, to a zigzag layout (rank r scores chunks r and 2cp - 1 - r of 2cp), as in zigzag ring attention.

The all-gathers are torch's autograd-aware functional collectives, so the backward pass is exact too: a
gather's backward reduce-scatters the gradients of what the other ranks read. That backward is a collective,
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
from parallel.compat import all_gather_autograd
from parallel.dims import Layout


class ContextSplit:
    """The SequenceSplit of one cp group: this rank holds slice `rank` of `size`."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """(...) -> (size, ...): every rank's x, in slice order."""
        return all_gather_autograd(x.unsqueeze(0).contiguous(), 0, self.group)

    def previous_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        tails = self._gather(x[:, x.shape[1] - n:])  # (size, B, n, D)
        if self.rank == 0:
            return tails[0] * 0  # the sequence's start: zero history, still on the gather's backward
        return tails[self.rank - 1]

    def through(self, x: torch.Tensor, end: int) -> torch.Tensor:
        return torch.cat(self._gather(x).unbind(0), dim=1)[:, :end]  # (B, end, D)

    # MLA's balance: the sequence in 2 * size equal chunks; rank r holds chunks 2r and 2r+1 and scores the
    # queries of chunks r and 2 size - 1 - r, a short and a long causal row: the same work on every rank.

    def scored_chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.size - 1 - self.rank

    def _scorer(self, chunk: int) -> int:
        return chunk if chunk < self.size else 2 * self.size - 1 - chunk

    def scored_pieces(self, length: int) -> list[tuple[int, int]]:
        return [(chunk * (length // 2), length // 2) for chunk in self.scored_chunks()]

    def balance(self, x: torch.Tensor) -> torch.Tensor:
        held = (2 * self.rank, 2 * self.rank + 1)
        return self._route(x, held, self.scored_chunks(), source_of=lambda c: c // 2, destination_of=self._scorer)

    def unbalance(self, x: torch.Tensor) -> torch.Tensor:
        held = (2 * self.rank, 2 * self.rank + 1)
        return self._route(x, self.scored_chunks(), held, source_of=self._scorer, destination_of=lambda c: c // 2)

    def _route(self, x: torch.Tensor, mine: tuple[int, int], wanted: tuple[int, int], source_of,
               destination_of) -> torch.Tensor:
        """x (B, T, ...) holding chunks `mine` in order -> (B, T, ...) holding chunks `wanted` in order, every
        chunk c sent from rank source_of(c) to rank destination_of(c) in one all-to-all (autograd: its backward
        sends the gradients back)."""
        pieces = x.unflatten(1, (2, -1)).movedim(1, 0)  # (2, B, T/2, ...)
        outgoing = sorted(range(2), key=lambda i: (destination_of(mine[i]), mine[i]))
        incoming = sorted(wanted, key=lambda c: (source_of(c), c))
        send_counts = [sum(destination_of(c) == r for c in mine) for r in range(self.size)]
        receive_counts = [sum(source_of(c) == r for c in wanted) for r in range(self.size)]
        received = funcol.all_to_all_single_autograd(pieces[outgoing].contiguous(), receive_counts, send_counts,
                                                     self.group)  # (2, B, T/2, ...) by source rank, then chunk
        return received[[incoming.index(c) for c in wanted]].movedim(0, 1).flatten(1, 2)  # (B, T, ...)

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

