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

from kernels.launch import Launch, compiled_for_gpu


def tiles(rows: int, width: int, gpu: bool) -> tuple[dict, int]:
    """(BLOCK_M rows, BLOCK_D = the whole row) and warps. On a GPU the tile holds 4096 elements, 32 per
    thread of 4 warps (more warps for rows over 4096): the backward keeps three such tiles live, so a
    larger tile spills (measured in docs/BENCHMARKS.md, "Kernels"). Under the CPU interpreter each
    program instance costs milliseconds, so the tile there is bigger."""
    block_d = triton.next_power_of_2(width)
    budget, num_warps = (4096, max(4, min(16, block_d // 1024))) if gpu else (1 << 16, 4)
    return dict(BLOCK_M=min(triton.next_power_of_2(rows), max(1, budget // block_d)), BLOCK_D=block_d), num_warps


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


def forward_launch(x_flat: torch.Tensor, weight: torch.Tensor, eps: float, gpu: bool):
    """x_flat (M, D) -> the launch and y (M, D) in x's dtype."""
    M, D = x_flat.shape
    y = torch.empty_like(x_flat)
    constexprs, num_warps = tiles(M, D, gpu)
    launch = Launch(_rms_norm_fwd, (triton.cdiv(M, constexprs["BLOCK_M"]),),
                    (x_flat, weight.contiguous(), y, M, D, eps), constexprs, num_warps)
    return launch, y


def backward_launch(x_flat: torch.Tensor, weight: torch.Tensor, d_y_flat: torch.Tensor, eps: float, gpu: bool):
    """x_flat, d_y_flat (M, D) -> the launch, d_x (M, D) and per-tile gain gradients (tiles, D) fp32."""
    M, D = x_flat.shape
    constexprs, num_warps = tiles(M, D, gpu)
    n_tiles = triton.cdiv(M, constexprs["BLOCK_M"])
    d_x = torch.empty_like(x_flat)
    d_weight_part = torch.empty(n_tiles, D, dtype=torch.float32, device=x_flat.device)
    launch = Launch(_rms_norm_bwd, (n_tiles,), (x_flat, weight.contiguous(), d_y_flat, d_x, d_weight_part, M, D, eps),
                    constexprs, num_warps)
    return launch, d_x, d_weight_part


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_flat = x.reshape(-1, x.shape[-1]).contiguous()  # (M, D)
        launch, y = forward_launch(x_flat, weight, eps, compiled_for_gpu(x.device))
        launch.run()
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_y: torch.Tensor):
        x, weight = ctx.saved_tensors
        D = x.shape[-1]
        launch, d_x, d_weight_part = backward_launch(x.reshape(-1, D).contiguous(), weight,
                                                     d_y.reshape(-1, D).contiguous(), ctx.eps,
                                                     compiled_for_gpu(x.device))  # (M, D)
        launch.run()
        return d_x.view(x.shape), d_weight_part.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)
