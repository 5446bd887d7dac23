"""Where depth blocks fall: the one description of AttnRes block geometry, asked by the mixer, the pipeline
plan, FSDP's unit grouping and the memory planner.

Two kinds of block, never to be confused:
- a *transformer block* b (0-based, `model.n_blocks` of them) holds sublayers 2b+1 (token mixer) and 2b+2
  (channel mixer);
- a *depth block* n (1-based) is the paper's AttnRes block: sublayers (n-1)S+1 .. min(nS, L) whose outputs
  sum into one source b_n. b_0 is the embedding. Full AttnRes is S = 1 (every output is its own depth block).
Sublayers are in paper units, 1-based; L + 1 names the final read. Variants that do not attend over depth
(the baseline family, mHC) have no depth blocks: `attends` is False and only `units` applies to them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from model.config import ModelConfig


def token_mixer_sublayer(transformer_block: int) -> int:
    """The sublayer (paper units) of transformer block b's token mixer: 2b+1; its channel mixer is the next."""
    return 2 * transformer_block + 1


def channel_mixer_sublayer(transformer_block: int) -> int:
    return 2 * transformer_block + 2


def transformer_block_of(sublayer: int) -> int:
    return (sublayer - 1) // 2


@dataclass(frozen=True)
class DepthGeometry:
    n_sublayers: int          # L
    size: int | None          # S, sublayers per depth block; None when the variant has no depth blocks
    two_phase: bool           # the read may batch a depth block's queries at its first sublayer (Algorithm 1)
    window: int | None        # reads see b_0 plus the last `window` sources

    @classmethod
    def of(cls, cfg: ModelConfig) -> DepthGeometry:
        r = cfg.residual
        if r.kind == "full":
            size = 1
        elif r.kind == "block":
            size = r.block_size if r.block_size is not None else max(1, round(cfg.n_sublayers / 8))
        else:
            size = None
        two_phase = (size is not None and r.two_phase is not False and r.query == "learned"
                     and r.mixing == "attention" and r.window is None)
        return cls(cfg.n_sublayers, size, two_phase, r.window)

    @property
    def attends(self) -> bool:
        return self.size is not None

    def _size(self) -> int:
        if self.size is None:
            raise ValueError("this residual variant has no depth blocks (only full and block attend over depth)")
        return self.size

    # -- one sublayer -------------------------------------------------------------------------------

    def position(self, sublayer: int) -> int:
        """0-based position of `sublayer` inside its depth block."""
        return (sublayer - 1) % self._size()

    def depth_block_end(self, sublayer: int) -> int:
        """The last sublayer of the depth block `sublayer` belongs to (the model's last at most)."""
        size = self._size()
        return min(((sublayer - 1) // size + 1) * size, self.n_sublayers)

    def closes_depth_block(self, sublayer: int) -> bool:
        """Whether `sublayer`'s write completes a depth block of S sublayers. A shorter trailing depth block
        (L not a multiple of S) never closes: the final read sees it as the open partial sum."""
        return sublayer % self._size() == 0

    def n_sources(self, sublayer: int) -> int:
        """Sources the read before `sublayer` sees: completed depth blocks (b_0 included), the partial sum of
        an open one, capped by the window."""
        n = self.blocks_done(sublayer - 1) + int(self.partial_open(sublayer - 1))
        return n if self.window is None else min(n, 1 + self.window)

    def sources_read(self) -> int:
        """n_sources summed over every read, the final one included, in closed form (a config is sized by it
        before anything is built, however deep). With d = sublayer - 1 in 0..L a read sees
        1 + min(ceil(d / S), window) sources; the sum over d of min(ceil(d / S), K) is K L - S K (K - 1) / 2,
        with K the window capped at the ceil(L / S) depth blocks there are."""
        size, done = self._size(), self.n_sublayers
        k = -(-done // size) if self.window is None else min(self.window, -(-done // size))
        return done + 1 + k * done - size * k * (k - 1) // 2

    # -- after the first `done` sublayers ------------------------------------------------------------

    def blocks_done(self, done: int) -> int:
        """Completed depth blocks, b_0 included, once sublayers 1..done have written."""
        return 1 + done // self._size()

    def partial_open(self, done: int) -> bool:
        """Whether a depth block is still accumulating once sublayers 1..done have written."""
        return done % self._size() != 0

    @property
    def max_sources(self) -> int:
        """Sources the final read sees: b_0 and every depth block (the last may be partial): N + 1."""
        return 1 + math.ceil(self.n_sublayers / self._size())

    # -- units of transformer blocks ----------------------------------------------------------------

    def unit_may_end_after(self, transformer_block: int) -> bool:
        """Whether a unit that is gathered (FSDP) as a whole may end after this transformer block: the two-phase
        read's first sublayer batches the queries of its whole depth block, so no unit may cut one."""
        return not self.two_phase or channel_mixer_sublayer(transformer_block) % self._size() == 0

    def units(self, transformer_blocks: list[int]) -> list[list[int]]:
        """Consecutive `transformer_blocks` cut wherever `unit_may_end_after` allows, and at the end."""
        units, unit = [], []
        for block in transformer_blocks:
            unit.append(block)
            if self.unit_may_end_after(block):
                units.append(unit)
                unit = []
        return units + ([unit] if unit else [])
