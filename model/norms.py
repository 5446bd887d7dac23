"""RMSNorm, computed in fp32 and returned in the input dtype."""
from __future__ import annotations

import torch
from torch import nn


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 for statistics (fp64 stays fp64, for double-precision tests)."""
    return x if x.dtype == torch.float64 else x.float()


def rms_inv(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS over the last dim, in fp32 (or fp64), keepdim."""
    return torch.rsqrt(upcast(x).pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((upcast(x) * rms_inv(x, self.eps)) * upcast(self.weight)).to(x.dtype)
