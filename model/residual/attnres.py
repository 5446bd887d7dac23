"""Full and Block Attention Residuals: one mixer, Full is Block with depth blocks of one sublayer.

Depth block n (1-based; model/residual/geometry.py) holds sublayers (n-1)S+1 .. nS. Sublayer l at
position i (0-based) in depth block n reads
    i == 0: [b_0 .. b_{n-1}]            i > 0: [b_0 .. b_{n-1}, b_n^{i}]   (b_n^{i}: partial sum)
where b_0 is the embedding. With S = 1 every output is its own depth block: Full AttnRes. The final read
attends over all completed depth blocks plus the trailing partial sum. Ablations (query, kernel, key norm,
static mixing, heads, window) are options of the same read.
"""
from __future__ import annotations

import torch

from kernels.attnres import depth_attention, fused, inverse_rms, phase1, phase2, source_weights, weighted_sum
from model.config import ResidualConfig
from model.residual.base import DepthState, ResidualMixer
from model.residual.geometry import DepthGeometry
from model.residual.read import DepthRead


class AttnResidual(ResidualMixer):
    def __init__(self, d_model: int, eps: float, options: ResidualConfig, geometry: DepthGeometry,
                 impl: str = "auto"):
        super().__init__(d_model, geometry.n_sublayers, eps)
        self.options = options
        self.impl = impl  # the two-phase read's kernels (kernels.attnres); the per-layer read is reference-only
        self.geometry = geometry
        self.heads = options.heads

    def n_sources(self, sublayer: int) -> int:
        """How many sources the read before `sublayer` sees (n_sublayers + 1: the final read)."""
        return self.geometry.n_sources(sublayer)

    def make_read(self, sublayer: int) -> DepthRead:
        return DepthRead(self.d_model, self.options, self.n_sources(sublayer), self.eps)

    def start(self, embedding: torch.Tensor) -> DepthState:
        return DepthState(blocks=[embedding], partial=None)

    # -- reads ---------------------------------------------------------------------------------

    def read(self, state: DepthState, read: DepthRead) -> torch.Tensor:
        sublayer = state.next_sublayer
        with_partial = self.geometry.position(sublayer) > 0 and state.partial is not None
        if self.batches(state):
            return self._two_phase_read(state, read, sublayer, with_partial)
        return self._read_sources(state, read, sublayer, with_partial)

    def batches(self, state: DepthState) -> bool:
        """Whether reads take Algorithm 1's batched two-phase form: always with two_phase=true, and with
        two_phase=null where its fused kernels run. On the plain-torch reference the per-layer read computes
        the same values faster (measured in docs/BENCHMARKS.md, "Block's overhead per device"): the batching
        saves kernel launches and reads of the blocks, which a CPU's reference does not pay for."""
        if not self.geometry.two_phase:
            return False
        return self.options.two_phase is True or fused(self.impl, self.options.kernel, state.blocks[0])

    def final(self, state: DepthState, read: DepthRead) -> torch.Tensor:
        return self._read_sources(state, read, self.n_sublayers + 1, state.partial is not None)

    def _key_norm_eps(self, read: DepthRead) -> float | None:
        return self.eps if read.key_norm is not None else None

    def _key_inv_rms(self, source: torch.Tensor) -> torch.Tensor:
        return inverse_rms(source, self.heads, self.eps)

    def _block_inv_rms(self, state: DepthState) -> list[torch.Tensor]:
        # Each block's key norm is computed once, however many sublayers read it.
        for block in state.blocks[len(state.block_inv_rms):]:
            state.block_inv_rms.append(self._key_inv_rms(block))
        return state.block_inv_rms

    def _read_sources(self, state: DepthState, read: DepthRead, sublayer: int, with_partial: bool) -> torch.Tensor:
        """The per-layer read over the sources (all blocks, the partial sum, the window)."""
        sources = list(state.blocks) + ([state.partial] if with_partial else [])
        keep = list(range(len(sources)))
        if self.options.window is not None:
            keep = [0] + keep[max(1, len(sources) - self.options.window):]
        values = [sources[i] for i in keep]
        if read.is_static:
            weights = read.static_weights(self.options.kernel)[:, None, None, None]  # (N, 1, 1, 1)
            h = weighted_sum(weights, values)
        else:
            inv_rms = None
            if read.key_norm is not None:
                per_source = self._block_inv_rms(state) + ([self._key_inv_rms(state.partial)] if with_partial else [])
                inv_rms = [per_source[i] for i in keep]
            h, weights = depth_attention(values, read.query_for(sources[-1]), inv_rms, self.options.kernel)
        self._record_weights(state, sublayer, weights, keep, h)
        return h

    def _two_phase_read(self, state: DepthState, read: DepthRead, sublayer: int, with_partial: bool) -> torch.Tensor:
        """Algorithm 1: one batched inter-block read per depth block, then a merge with the partial sum."""
        if sublayer not in state.phase1:
            self._run_phase1(state, sublayer)
        o1, m1, l1, scores1 = state.phase1.pop(sublayer)
        kernel = self.options.kernel
        if not with_partial:
            h = o1 if kernel != "softmax" else (o1.unflatten(-1, (self.heads, -1)) / l1.unsqueeze(-1)).flatten(-2)
            h = h.to(state.blocks[0].dtype)
            self._record_weights(state, sublayer, source_weights(scores1, kernel), None, h)
            return h
        h, scores2 = phase2(o1, m1, l1, state.partial, read.learned_query(), self._key_norm_eps(read), kernel,
                            impl=self.impl)
        if state.diagnostics is not None or state.trace is not None:
            self._record_weights(state, sublayer, source_weights(torch.cat([scores1, scores2]), kernel), None, h)
        return h

    def _run_phase1(self, state: DepthState, sublayer: int) -> None:
        """Batch every query of this depth block that lives here (a pipeline stage may hold only part of it)."""
        members = [l for l in range(sublayer, self.geometry.depth_block_end(sublayer) + 1)
                   if l in state.reads and l not in state.skipped]
        if sublayer not in state.reads:
            raise KeyError(f"depth read for sublayer {sublayer} is not registered in DepthState.reads")
        reads = [state.reads[l] for l in members]
        queries = torch.stack([r.learned_query() for r in reads])  # (S, H, d/H)
        o, m, l, scores = phase1(state.blocks, queries, self._key_norm_eps(reads[0]), self.options.kernel,
                                 impl=self.impl, known_inv_rms=state.block_inv_rms)
        for j, member in enumerate(members):
            state.phase1[member] = (o[j], m[j], l[j], scores[j])

    # -- writes --------------------------------------------------------------------------------

    def write(self, state: DepthState, output: torch.Tensor) -> None:
        self.record_output(state, output)
        position = self.geometry.position(state.next_sublayer)
        state.partial = output if position == 0 or state.partial is None else state.partial + output
        if state.trace is not None:
            state.trace.carry["partial"].append(state.next_sublayer)
        self._close_depth_block(state)

    def skip(self, state: DepthState) -> None:
        """A skipped sublayer adds nothing to its depth block; a depth block whose sublayers were all skipped is
        absent."""
        self._close_depth_block(state)

    def _close_depth_block(self, state: DepthState) -> None:
        if self.geometry.closes_depth_block(state.next_sublayer) and state.partial is not None:
            state.blocks.append(state.partial)
            state.partial = None
            if state.trace is not None:
                state.trace.carry["blocks"].append(state.trace.carry["partial"])
                state.trace.carry["partial"] = []
        state.next_sublayer += 1

    # -- what the reads saw ----------------------------------------------------------------------

    def initial_carry(self, embedding: torch.Tensor) -> dict[str, list]:
        """The sublayers each source sums (a block's outputs all enter with weight 1): b_0 is v_0."""
        return {"blocks": [[0]], "partial": []}

    def _record_weights(self, state: DepthState, sublayer: int, weights: torch.Tensor, keep, h: torch.Tensor) -> None:
        """weights (N, B, T, H) or (N, 1, 1, 1) over the sources read (all, or those in `keep`): the mean per
        source into the diagnostics (by source index), the row of M per token into the trace."""
        indices = keep if keep is not None else list(range(weights.shape[0]))
        if state.diagnostics is not None:
            mean = weights.detach().double().reshape(weights.shape[0], -1).mean(-1).tolist()
            state.diagnostics.setdefault("depth_weights", {})[sublayer] = dict(zip(indices, mean))
        if state.trace is not None:
            carry = state.trace.carry
            members = carry["blocks"] + ([carry["partial"]] if carry["partial"] else [])
            weights = weights.detach().to(h.dtype).expand(-1, *h.shape[:2], -1)   # (N, B, T, G)
            row = h.new_zeros(*weights.shape[1:], sublayer)                       # (B, T, G, l)
            for weight, source in zip(weights, indices):
                row[..., members[source]] += weight.unsqueeze(-1)
            state.trace.add_row(sublayer, row, h)
