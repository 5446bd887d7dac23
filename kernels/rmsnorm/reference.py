"""Plain-torch RMSNorm with a learnable gain: the readable oracle.

Statistics in fp32 (fp64 stays fp64, for double-precision tests); the result is in the input dtype.
"""
from __future__ import annotations

import torch


def _stats(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., d), weight (d,) -> x / sqrt(mean(x^2) + eps) * weight over the last dim."""
    stats = _stats(x)
    inv_rms = torch.rsqrt(stats.pow(2).mean(-1, keepdim=True) + eps)
    return ((stats * inv_rms) * _stats(weight)).to(x.dtype)
