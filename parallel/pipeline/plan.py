"""The static pipeline plan: which blocks each chunk runs, and what crosses each transition.

Everything here is a function of the model config and the layout (P ranks, V virtual stages per
rank), so receive buffers can be allocated once and the communication volume can be computed without
running anything. Notation: chunk c (0..C-1, C = P*V) runs on rank c mod P and holds consecutive
transformer blocks; what crosses a cut is depth blocks (model/residual/geometry.py), b_0 (the embedding),
b_1, ...; for Full every sublayer output is a depth block.
"""
from __future__ import annotations

from dataclasses import dataclass

from model.config import STREAM_VARIANTS, ModelConfig
from model.residual.base import CarryLayout
from model.residual.geometry import DepthGeometry, channel_mixer_sublayer, token_mixer_sublayer


@dataclass(frozen=True)
class Transition:
    """What chunk `sender` sends to chunk sender+1 for one microbatch."""
    sender: int
    first_block: int          # depth blocks [first_block, last_block) are sent
    last_block: int
    sends_partial: bool       # the current depth block straddles the cut: its partial sum goes along
    held_by_receiver: int     # depth blocks [0, held) come from the receiver's own cache

    @property
    def n_blocks(self) -> int:
        return self.last_block - self.first_block

    @property
    def n_tensors(self) -> int:
        return self.n_blocks + int(self.sends_partial)


class PipelinePlan:
    def __init__(self, cfg: ModelConfig, pp: int, vp: int, cache: bool):
        self.cfg, self.pp, self.vp, self.cache = cfg, pp, vp, cache
        self.n_chunks = pp * vp
        if self.n_chunks > cfg.n_blocks:
            raise ValueError(f"pp * vp = {pp} * {vp} = {self.n_chunks} chunks is more than model.n_blocks="
                             f"{cfg.n_blocks} transformer blocks; lower parallel.pp or parallel.vp")
        self.geometry = DepthGeometry.of(cfg)
        self.attnres = self.geometry.attends  # else one running sum crosses each cut
        self.sends_embedding = cfg.residual.kind == "x0"  # x0's reads need v_0 beside the sum
        # mHC and HC carry m streams (m, B, T, d) instead of one sum: m tensors cross each cut.
        self.streams = cfg.residual.streams if cfg.residual.kind in STREAM_VARIANTS else 1
        base, extra = divmod(cfg.n_blocks, self.n_chunks)
        sizes = [base + int(c < extra) for c in range(self.n_chunks)]  # earlier chunks take the remainder
        starts = [sum(sizes[:c]) for c in range(self.n_chunks)]
        self.chunk_blocks = [list(range(s, s + n)) for s, n in zip(starts, sizes)]

    def chunks_of(self, rank: int) -> list[int]:
        return [rank + v * self.pp for v in range(self.vp)]

    def first_sublayer(self, chunk: int) -> int:
        return token_mixer_sublayer(self.chunk_blocks[chunk][0])

    def sublayers_done(self, chunk: int) -> int:
        """Sublayers that have written at the end of `chunk`."""
        return channel_mixer_sublayer(self.chunk_blocks[chunk][-1])

    def blocks_done(self, chunk: int) -> int:
        """Completed depth blocks (b_0 included) at the end of `chunk`."""
        return self.geometry.blocks_done(self.sublayers_done(chunk))

    def partial_open(self, chunk: int) -> bool:
        """Whether a depth block is still accumulating at the end of `chunk`."""
        return self.geometry.partial_open(self.sublayers_done(chunk))

    def held_at_start(self, chunk: int) -> int:
        """Depth blocks the rank running `chunk` already holds for this microbatch (from chunk - P)."""
        earlier = chunk - self.pp
        return self.blocks_done(earlier) if self.cache and earlier >= 0 else 0

    def transition(self, sender: int) -> Transition:
        receiver = sender + 1
        held = self.held_at_start(receiver)
        return Transition(sender, held, self.blocks_done(sender), self.partial_open(sender), held)

    def message_layout(self, sender: int) -> CarryLayout:
        """Where the DepthState's fields lie in the message chunk `sender` sends (mHC's (m, B, T, d) streams
        counted as its one partial)."""
        if not self.attnres:  # the running sum, then x0's v_0
            return CarryLayout.of_message(True, int(self.sends_embedding))
        transition = self.transition(sender)
        return CarryLayout.of_message(transition.sends_partial, transition.n_blocks)

    def caches_after(self, chunk: int) -> bool:
        """Whether the rank keeps this chunk's depth blocks for its next virtual stage."""
        return self.cache and chunk + self.pp < self.n_chunks

    # -- communication volume, in d-sized vectors per token ----------------------------------------

    def sent_vectors(self) -> list[int]:
        """Per transition: vectors per token that cross it (baseline: the hidden state; mHC: its m streams)."""
        if not self.attnres:
            return [self.streams + int(self.sends_embedding)] * (self.n_chunks - 1)
        return [self.transition(c).n_tensors for c in range(self.n_chunks - 1)]

    def blocks_per_chunk(self) -> float:
        """N_p of the paper: depth blocks produced per chunk on average (b_0 not counted)."""
        return (self.blocks_done(self.n_chunks - 1) - 1 + int(self.partial_open(self.n_chunks - 1))) / self.n_chunks
