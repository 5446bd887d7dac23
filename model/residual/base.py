"""The residual-mixer interface: how sublayer inputs are read from, and outputs written to, depth.

A decoder runs, for each sublayer l = 1..L (paper units: attention and MLP count one each):
    h_l = mixer.read(state, read_l);  v_l = f_l(norm(h_l));  mixer.write(state, v_l)
and ends with mixer.final(state, final_read). `read_l` holds the sublayer's own residual parameters
(None for the baseline); it lives in the transformer block so that a pipeline stage that deletes a
block also deletes its residual parameters.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model.residual.trace import DepthTrace


@dataclass(frozen=True)
class CarryLayout:
    """Where a DepthState's crossing fields lie in the flat tuple `DepthState.carry` makes. Carry order:
    partial, the blocks, the key norms, then each phase-1 entry's tensors by sublayer; `present` has one
    flag per slot, False where the field is None (no tensor travels for it)."""
    n_blocks: int
    n_inv_rms: int
    phase1: tuple[tuple[int, int], ...]  # (sublayer, entries)
    present: tuple[bool, ...]

    @classmethod
    def of_message(cls, has_partial: bool, n_blocks: int) -> CarryLayout:
        """A pipeline message: the partial sum (if any), then blocks; memos never cross a stage."""
        return cls(n_blocks, 0, (), (has_partial,) + (True,) * n_blocks)


@dataclass
class DepthState:
    """Everything that flows along depth for one batch of tokens.

    blocks: completed sources b_0 (the embedding), b_1, ... (Full: every sublayer output).
    partial: sum of the current block's outputs so far (the baseline keeps its running sum here;
        mHC its m streams as one (m, B, T, d) tensor).
    next_sublayer: paper index of the sublayer that reads next (1-based).
    block_inv_rms and phase1 are memos, recomputable from the above: a pipeline stage drops them, a
    checkpointed block carries them. The rest is context the receiver of a carry supplies.
    """
    blocks: list[torch.Tensor]
    partial: torch.Tensor | None
    next_sublayer: int = 1
    reads: dict[int, nn.Module] = field(default_factory=dict)       # sublayer -> read params present here
    block_inv_rms: list[torch.Tensor] = field(default_factory=list)  # per block, (B, T, H)
    phase1: dict[int, tuple] = field(default_factory=dict)           # sublayer -> batched inter-block read
    diagnostics: dict | None = None                                  # filled when requested
    pending_write: tuple | None = None      # mHC: the read's (beta, A); Highway: its gate, for the write
    trace: DepthTrace | None = None                                  # the depth-mixing matrix, when requested
    skipped: set[int] = field(default_factory=set)                   # sublayers that do not run (ReSkip)

    def carry(self) -> tuple[tuple[torch.Tensor, ...], CarryLayout]:
        """The tensors that cross a boundary (a pipeline cut, a checkpointed block) as one flat tuple, and
        where each lies. `pending_write` lives between a read and its write inside one block, so it is
        never carried (refused here, not dropped)."""
        if self.pending_write is not None:
            raise RuntimeError(f"sublayer {self.next_sublayer}: a pending write cannot cross a block boundary")
        keys = sorted(self.phase1)
        slots = [self.partial, *self.blocks, *self.block_inv_rms, *(t for k in keys for t in self.phase1[k])]
        layout = CarryLayout(len(self.blocks), len(self.block_inv_rms), tuple((k, len(self.phase1[k])) for k in keys),
                             tuple(t is not None for t in slots))
        return tuple(t for t in slots if t is not None), layout

    @classmethod
    def from_carry(cls, tensors: tuple[torch.Tensor, ...], layout: CarryLayout, **context) -> DepthState:
        """The state `carry` flattened, with `context` (next_sublayer, reads, diagnostics, ...) supplied."""
        stream = iter(tensors)
        partial, *rest = [next(stream) if present else None for present in layout.present]
        blocks, rest = rest[:layout.n_blocks], rest[layout.n_blocks:]
        inv_rms, rest = rest[:layout.n_inv_rms], rest[layout.n_inv_rms:]
        phase1 = {}
        for key, entries in layout.phase1:
            phase1[key], rest = tuple(rest[:entries]), rest[entries:]
        return cls(blocks=blocks, partial=partial, block_inv_rms=inv_rms, phase1=phase1, **context)


class ResidualMixer:
    """Strategy for one residual variant; holds no parameters itself (see `make_read`)."""

    def __init__(self, d_model: int, n_sublayers: int, eps: float):
        self.d_model = d_model
        self.n_sublayers = n_sublayers
        self.eps = eps

    def make_read(self, sublayer: int) -> nn.Module | None:
        """Parameters of the read before `sublayer` (n_sublayers + 1 is the final read)."""
        return None

    def start(self, embedding: torch.Tensor) -> DepthState:
        raise NotImplementedError

    def read(self, state: DepthState, read: nn.Module | None) -> torch.Tensor:
        raise NotImplementedError

    def write(self, state: DepthState, output: torch.Tensor) -> None:
        raise NotImplementedError

    def final(self, state: DepthState, read: nn.Module | None) -> torch.Tensor:
        raise NotImplementedError

    def skip(self, state: DepthState) -> None:
        """The next sublayer does not run (ReSkip): no read, no output; what it would have added is absent."""
        state.next_sublayer += 1

    def start_trace(self, state: DepthState, trace: DepthTrace, embedding: torch.Tensor) -> None:
        """Attach `trace` to a state just started from `embedding` (v_0)."""
        state.trace = trace
        trace.add_output(embedding)
        trace.carry = self.initial_carry(embedding)

    def initial_carry(self, embedding: torch.Tensor):
        """What the state holds in the trace's coefficients before the first sublayer."""
        raise NotImplementedError

    def record_output(self, state: DepthState, output: torch.Tensor) -> None:
        if state.trace is not None:
            state.trace.add_output(output)
        if state.diagnostics is not None:
            rms = output.detach().double().pow(2).mean().sqrt().item()
            state.diagnostics.setdefault("output_rms", {})[state.next_sublayer] = rms
