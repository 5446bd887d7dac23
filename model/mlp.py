"""SwiGLU channel mixer: the dense layer-0 MLP and the MoE shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.init import InitStds


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, inter, bias=False)
        self.up_proj = nn.Linear(d_model, inter, bias=False)
        self.down_proj = nn.Linear(inter, d_model, bias=False)

    def init_weights(self, stds: InitStds) -> None:
        nn.init.normal_(self.gate_proj.weight, std=stds.hidden)
        nn.init.normal_(self.up_proj.weight, std=stds.hidden)
        nn.init.normal_(self.down_proj.weight, std=stds.output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
