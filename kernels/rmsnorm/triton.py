"""Fused RMSNorm, forward and backward, in Triton. Same contract as `reference.rms_norm`.

Each program normalises BLOCK_M whole rows (the row width d is one tile). Backward recomputes the
inverse RMS from x rather than storing it; the gain's gradient is summed per program and the
partial sums are added in torch (deterministic, unlike atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable


def tiles(rows: int, width: int, device: torch.device):
    """(BLOCK_M, BLOCK_D). A GPU keeps the tile in registers; under the CPU interpreter each program
    instance costs milliseconds, so the tile there is bigger."""
    budget = 8192 if device.type == "cuda" else 1 << 16
    block_d = triton.next_power_of_2(width)
    return min(triton.next_power_of_2(rows), max(1, budget // block_d)), block_d


@triton.jit
def _rms_norm_fwd(x, weight, y, M, D, eps, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    at, ok = rows[:, None] * D + cols[None, :], (rows < M)[:, None] & (cols < D)[None, :]
    xv = tl.load(x + at, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xv * xv, axis=1) / D + eps)
    tl.store(y + at, (xv * inv[:, None] * g[None, :]).to(y.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_bwd(x, weight, d_y, d_x, d_weight_part, M, D, eps, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    tile = tl.program_id(0)
    rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    at, ok = rows[:, None] * D + cols[None, :], (rows < M)[:, None] & (cols < D)[None, :]
    xv = tl.load(x + at, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(d_y + at, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xv * xv, axis=1) / D + eps)
    # y = x inv g with inv = (mean(x^2) + eps)^(-1/2): dx = inv g dy - inv^3 x sum(x g dy) / D.
    g_dy = g[None, :] * dy
    dx = inv[:, None] * g_dy - (inv * inv * inv * tl.sum(xv * g_dy, axis=1) / D)[:, None] * xv
    tl.store(d_x + at, dx.to(d_x.dtype.element_ty), mask=ok)
    tl.store(d_weight_part + tile * D + cols, tl.sum(dy * xv * inv[:, None], axis=0), mask=cols < D)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        D = x.shape[-1]
        x_flat = x.reshape(-1, D).contiguous()  # (M, D)
        y = torch.empty_like(x_flat)
        block_m, block_d = tiles(x_flat.shape[0], D, x.device)
        _rms_norm_fwd[(triton.cdiv(x_flat.shape[0], block_m),)](
            x_flat, weight.contiguous(), y, x_flat.shape[0], D, eps, BLOCK_M=block_m, BLOCK_D=block_d)
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_y: torch.Tensor):
        x, weight = ctx.saved_tensors
        D = x.shape[-1]
        x_flat = x.reshape(-1, D).contiguous()  # (M, D)
        M = x_flat.shape[0]
        block_m, block_d = tiles(M, D, x.device)
        n_tiles = triton.cdiv(M, block_m)
        d_x = torch.empty_like(x_flat)
        d_weight_part = torch.empty(n_tiles, D, dtype=torch.float32, device=x.device)
        _rms_norm_bwd[(n_tiles,)](x_flat, weight.contiguous(), d_y.reshape(-1, D).contiguous(), d_x, d_weight_part,
                                  M, D, ctx.eps, BLOCK_M=block_m, BLOCK_D=block_d)
        return d_x.view(x.shape), d_weight_part.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)
