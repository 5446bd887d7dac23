"""The depth-mixing matrix M of any residual variant, as its mixer computes it (paper section 6.2).

Every sublayer input is h_l = sum_{i<l} M[i->l] v_i, with v_0 the embedding and v_i sublayer i's output.
A DepthTrace attached to the DepthState collects, for every read (l = L+1 is the final read), the row
M[:, l] per token: a (B, T, G, l) tensor of the coefficients of v_0 .. v_{l-1}, for G channel groups of
d/G channels each (1 when one weight mixes whole vectors, the heads of multi-head depth attention, d for
elementwise Highway gates). Each mixer keeps in `carry` what its own state holds in these coefficients
(the running sum's, the streams', the blocks' member sublayers) and derives the rows from its realised
weights, never from h itself, so comparing sum_i M v_i with h checks the mixer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DepthTrace:
    keep_tensors: bool = False  # keep h_l and v_i to check the rows against what the model computed
    rows: dict[int, torch.Tensor] = field(default_factory=dict)      # sublayer -> (B, T, G, l)
    carry: object = None
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)    # sublayer -> h_l (B, T, d)
    outputs: list[torch.Tensor] = field(default_factory=list)        # v_0, v_1, ... (B, T, d)

    def add_row(self, sublayer: int, row: torch.Tensor, h: torch.Tensor) -> None:
        if row.shape[-1] != sublayer:
            raise RuntimeError(f"depth trace: the row of sublayer {sublayer} covers {row.shape[-1]} sources")
        self.rows[sublayer] = row.detach()
        if self.keep_tensors:
            self.inputs[sublayer] = h.detach()

    def add_output(self, output: torch.Tensor) -> None:
        if self.keep_tensors:
            self.outputs.append(output.detach())

    def matrix(self) -> torch.Tensor:
        """(B, T, G, L+1, L+1): row l-1 holds M[i->l] for i < l, zeros above the diagonal."""
        size = max(self.rows)
        first = self.rows[size]
        full = first.new_zeros(*first.shape[:2], max(r.shape[2] for r in self.rows.values()), size, size)
        for sublayer, row in self.rows.items():
            full[..., sublayer - 1, :sublayer] = row
        return full

    def reconstruct(self, sublayer: int) -> torch.Tensor:
        """sum_i M[i->l] v_i from the kept outputs: (B, T, d)."""
        row = self.rows[sublayer]                              # (B, T, G, l)
        values = torch.stack(self.outputs[:sublayer], -1)     # (B, T, d, l)
        groups = row.shape[2]
        values = values.unflatten(2, (groups, -1))             # (B, T, G, d/G, l)
        return (values * row.unsqueeze(3).to(values.dtype)).sum(-1).flatten(2)
