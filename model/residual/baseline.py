"""PreNorm baseline: h_l = sum_{i<l} v_i, a running sum."""
from __future__ import annotations

import torch

from model.residual.base import DepthState, ResidualMixer


class BaselineResidual(ResidualMixer):
    def start(self, embedding: torch.Tensor) -> DepthState:
        return DepthState(blocks=[], partial=embedding)

    def read(self, state: DepthState, read) -> torch.Tensor:
        return state.partial

    def write(self, state: DepthState, output: torch.Tensor) -> None:
        self.record_output(state, output)
        state.partial = state.partial + output
        state.next_sublayer += 1

    def final(self, state: DepthState, read) -> torch.Tensor:
        return state.partial
