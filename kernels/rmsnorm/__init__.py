"""RMSNorm with a learnable gain, dispatched by `impl = auto | torch | triton` (see kernels.select).
The fused kernel covers fp32, bf16 and fp16; fp64 (the tests' oracle precision) takes the reference."""
from __future__ import annotations

import torch

from kernels.rmsnorm.reference import rms_norm as reference_rms_norm
from kernels.select import use_triton

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    """x (..., d), weight (d,) -> RMSNorm(x) * weight in x's dtype, statistics in fp32."""
    if x.dtype in TRITON_DTYPES and use_triton(impl, x):
        from kernels.rmsnorm import triton as fused
        return fused.rms_norm(x, weight, eps)
    return reference_rms_norm(x, weight, eps)


__all__ = ["rms_norm"]
