"""SwiGLU channel mixer: the dense layer-0 MLP and the MoE shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, inter: int, init_std: float):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, inter, bias=False)
        self.up_proj = nn.Linear(d_model, inter, bias=False)
        self.down_proj = nn.Linear(inter, d_model, bias=False)
        for proj in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(proj.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
