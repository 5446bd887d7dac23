"""RMSNorm, computed in fp32 and returned in the input dtype (kernels.rmsnorm: reference or fused)."""
from __future__ import annotations

import torch
from torch import nn

from kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, impl: str = "torch"):
        super().__init__()
        self.eps = eps
        self.impl = impl  # auto | torch | triton (ModelConfig.kernel_impl for the model's norms)
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self, stds) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.impl)
