"""Fused Triton kernels for the two-phase AttnRes depth read, forward and backward.

Same contracts as `reference.phase1` / `reference.phase2` for the softmax kernel, with the key norm
fused: callers pass the key-norm epsilon (None: no key norm) instead of precomputed inverse RMS.

Layout: tokens are flattened to M = B*T rows of width d = H * HD (H depth-attention heads). Each
program owns BLOCK_M tokens of one head and sweeps that head's columns in BLOCK_D chunks twice: the
first sweep accumulates dot products and sums of squares (a softmax needs every score before any
weight), the second writes outputs. Within a sweep every block representation is read once for all
S queries: the blocks form one (BLOCK_M, BLOCK_N, BLOCK_D) tile, gathered through a table of their
data pointers, so they are never stacked into a copy.

Backward recomputes the scores, the softmax and the key norm from the inputs instead of storing
them. Statistics and accumulations are fp32 whatever the input dtype (fp32, bf16 or fp16); the
dot products' operand precision follows `dot_precision`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernels.launch import Launch, compiled_for_gpu

# tl.dot needs every dimension >= 16 on a GPU, so the source and query axes are padded to 16.
MIN_DOT = 16
# Under the CPU interpreter each program instance costs milliseconds, so tiles there are large.
INTERPRETER_TILE = 1 << 16


def phase1_tiles(tokens: int, head_dim: int, n_sources: int, n_queries: int, gpu: bool, backward: bool) -> tuple[dict, int]:
    """Phase 1's tile (BLOCK_M tokens, BLOCK_N sources, BLOCK_S queries, BLOCK_D columns) and warps.

    On a GPU the largest register tiles, (BLOCK_M, BLOCK_N, BLOCK_D) and (BLOCK_M, BLOCK_N, BLOCK_S),
    hold 16 elements per thread forward and 4 backward (which keeps about four such tiles live at
    once), sized so that no configuration spills registers (`python -m scripts.kernel_report`; the
    register counts are in docs/BENCHMARKS.md, "Kernels").
    """
    block_n = max(MIN_DOT, triton.next_power_of_2(n_sources))
    block_s = max(MIN_DOT, triton.next_power_of_2(n_queries))
    widest = max(MIN_DOT, triton.next_power_of_2(head_dim))
    if gpu:
        block_d, budget, num_warps = min(widest, 16 if backward else 32), 1024 if backward else 4096, 8
    else:
        block_d, budget, num_warps = min(widest, 64), INTERPRETER_TILE, 4
    block_m = min(triton.next_power_of_2(tokens), max(1, budget // (block_n * max(block_d, block_s))))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_S=block_s, BLOCK_D=block_d), num_warps


def phase2_tiles(tokens: int, head_dim: int, gpu: bool) -> tuple[dict, int]:
    """Phase 2's (BLOCK_M tokens, BLOCK_D columns) tile of one head and its warps: on a GPU 2048
    elements over 4 warps (the backward keeps four such tiles live), sized not to spill."""
    widest = triton.next_power_of_2(head_dim)
    block_d, budget = (min(widest, 512), 2048) if gpu else (min(widest, 1024), INTERPRETER_TILE)
    block_m = min(triton.next_power_of_2(tokens), max(1, budget // block_d))
    return dict(BLOCK_M=block_m, BLOCK_D=block_d), 4


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots; bf16/fp16 inputs get tf32 tensor-core dots, whose 10-bit
    mantissa holds the blocks exactly and rounds the other operand (queries, weights, output
    gradients) to ~5e-4, well below bf16's own rounding. (The interpreter computes both in fp32.)"""
    return "ieee" if dtype == torch.float32 else "tf32"


# -- shared pieces -----------------------------------------------------------------------------------


@triton.jit
def _source_tile(bases, rows, src, cols, col_ok, M, N, D):
    """(BLOCK_M, BLOCK_N, BLOCK_D) fp32 tile of the sources; zero outside."""
    ptrs = bases[None, :, None] + (rows[:, None, None] * D + cols[None, None, :])
    mask = (rows < M)[:, None, None] & (src < N)[None, :, None] & col_ok[None, None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _query_tile(queries, qry, cols, col_ok, S, D):
    """(BLOCK_S, BLOCK_D) fp32 tile of the queries (S, D); zero outside."""
    mask = (qry < S)[:, None] & col_ok[None, :]
    return tl.load(queries + qry[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _dot_queries(x, q, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """x (BLOCK_M, BLOCK_N, BLOCK_D) . q (BLOCK_S, BLOCK_D) -> (BLOCK_M, BLOCK_N, BLOCK_S)."""
    flat = tl.reshape(x, (BLOCK_M * BLOCK_N, BLOCK_D))
    return tl.reshape(tl.dot(flat, tl.trans(q), input_precision=DOT_PRECISION), (BLOCK_M, BLOCK_N, BLOCK_S))


@triton.jit
def _inverse_rms(sum_sq, HD, eps, HAS_NORM: tl.constexpr):
    if HAS_NORM:
        inv = tl.rsqrt(sum_sq / HD + eps)
    else:
        inv = tl.full(sum_sq.shape, 1.0, tl.float32)
    return inv


@triton.jit
def _source_softmax(x_dot_q, sum_sq, src, N, HD, eps, HAS_NORM: tl.constexpr):
    """Scores (BLOCK_M, BLOCK_N, BLOCK_S) and their softmax over the sources (axis 1)."""
    inv = _inverse_rms(sum_sq, HD, eps, HAS_NORM)  # (BLOCK_M, BLOCK_N)
    scores = tl.where((src < N)[None, :, None], x_dot_q * inv[:, :, None], float("-inf"))
    m = tl.max(scores, axis=1)  # (BLOCK_M, BLOCK_S)
    p = tl.exp(scores - m[:, None, :])
    return inv, scores, m, p, tl.sum(p, axis=1)


# -- phase 1: S queries against the N completed blocks ---------------------------------------------


@triton.jit
def _phase1_fwd(table, first_block, queries, o, m_out, l_out, scores_out, M, N, S, H, HD, eps,
                HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1)
    D = H * HD
    rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    src, qry, chunk = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    bases = tl.load(table + src, mask=src < N, other=0).to(tl.pointer_type(first_block.dtype.element_ty))

    x_dot_q = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_S), tl.float32)
    sum_sq = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, HD, BLOCK_D):
        col_ok = start + chunk < HD
        cols = head * HD + start + chunk
        x = _source_tile(bases, rows, src, cols, col_ok, M, N, D)
        q = _query_tile(queries, qry, cols, col_ok, S, D)
        x_dot_q += _dot_queries(x, q, BLOCK_M, BLOCK_N, BLOCK_S, BLOCK_D, DOT_PRECISION)
        sum_sq += tl.sum(x * x, axis=2)
    inv, scores, m, p, l = _source_softmax(x_dot_q, sum_sq, src, N, HD, eps, HAS_NORM)

    row_ok = rows < M
    stat = (qry[None, :] * M + rows[:, None]) * H + head  # into (S, M, H)
    stat_ok = row_ok[:, None] & (qry < S)[None, :]
    tl.store(m_out + stat, m, mask=stat_ok)
    tl.store(l_out + stat, l, mask=stat_ok)
    score_at = ((qry[None, None, :] * N + src[None, :, None]) * M + rows[:, None, None]) * H + head  # (S, N, M, H)
    tl.store(scores_out + score_at, scores, mask=stat_ok[:, None, :] & (src < N)[None, :, None])

    weights = tl.permute(p, (0, 2, 1))  # (BLOCK_M, BLOCK_S, BLOCK_N)
    for start in range(0, HD, BLOCK_D):
        col_ok = start + chunk < HD
        cols = head * HD + start + chunk
        x = _source_tile(bases, rows, src, cols, col_ok, M, N, D)
        out = tl.dot(weights, x, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_S, BLOCK_D)
        out_at = (qry[None, :, None] * M + rows[:, None, None]) * D + cols[None, None, :]  # into (S, M, D)
        tl.store(o + out_at, out, mask=stat_ok[:, :, None] & col_ok[None, None, :])


@triton.jit
def _phase1_bwd(table, first_block, queries, d_o, d_m, d_l, d_blocks, d_queries_part, M, N, S, H, HD, eps,
                HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1)
    D = H * HD
    rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    src, qry, chunk = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    bases = tl.load(table + src, mask=src < N, other=0).to(tl.pointer_type(first_block.dtype.element_ty))
    row_ok = rows < M
    stat_ok = row_ok[:, None] & (qry < S)[None, :]
    grad_at = (qry[None, :, None] * M + rows[:, None, None]) * D  # into (S, M, D), plus columns

    x_dot_q = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_S), tl.float32)
    x_dot_do = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_S), tl.float32)
    sum_sq = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, HD, BLOCK_D):
        col_ok = start + chunk < HD
        cols = head * HD + start + chunk
        x = _source_tile(bases, rows, src, cols, col_ok, M, N, D)
        do = tl.load(d_o + grad_at + cols[None, None, :], mask=stat_ok[:, :, None] & col_ok[None, None, :], other=0.0)
        x_dot_do += tl.dot(x, tl.permute(do, (0, 2, 1)), input_precision=DOT_PRECISION)
        q = _query_tile(queries, qry, cols, col_ok, S, D)
        x_dot_q += _dot_queries(x, q, BLOCK_M, BLOCK_N, BLOCK_S, BLOCK_D, DOT_PRECISION)
        sum_sq += tl.sum(x * x, axis=2)
    inv, scores, m, p, l = _source_softmax(x_dot_q, sum_sq, src, N, HD, eps, HAS_NORM)

    stat = (qry[None, :] * M + rows[:, None]) * H + head
    dm = tl.load(d_m + stat, mask=stat_ok, other=0.0)
    dl = tl.load(d_l + stat, mask=stat_ok, other=0.0)
    # o = sum_n p_n x_n, l = sum_n p_n with p_n = exp(score_n - m): through p each score gets
    # p_n (x_n . do + dl); o and l also depend on m (by -o and -l), and m's gradient goes to the
    # maximal score, split evenly between ties as torch.amax does.
    d_scores = p * (x_dot_do + dl[:, None, :])
    d_max = dm - tl.sum(p * x_dot_do, axis=1) - dl * l  # (BLOCK_M, BLOCK_S)
    is_max = scores == m[:, None, :]
    n_max = tl.sum(is_max.to(tl.float32), axis=1)
    d_scores += tl.where(is_max, (d_max / n_max)[:, None, :], 0.0)
    # score = inv * (x . q): d/dq = inv x; d/dx = inv q - inv^3 (x . q) x / HD.
    d_dot = d_scores * inv[:, :, None]  # gradient of x . q
    d_dot_flat = tl.reshape(d_dot, (BLOCK_M * BLOCK_N, BLOCK_S))
    if HAS_NORM:
        d_norm = tl.sum(d_scores * x_dot_q, axis=2) * inv * inv * inv / HD  # (BLOCK_M, BLOCK_N)

    dx_at = (src[None, :, None] * M + rows[:, None, None]) * D  # into (N, M, D), plus columns
    dx_ok = row_ok[:, None, None] & (src < N)[None, :, None]
    for start in range(0, HD, BLOCK_D):
        col_ok = start + chunk < HD
        cols = head * HD + start + chunk
        x = _source_tile(bases, rows, src, cols, col_ok, M, N, D)
        do = tl.load(d_o + grad_at + cols[None, None, :], mask=stat_ok[:, :, None] & col_ok[None, None, :], other=0.0)
        q = _query_tile(queries, qry, cols, col_ok, S, D)
        dx = tl.dot(p, do, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N, BLOCK_D)
        dx += tl.reshape(tl.dot(d_dot_flat, q, input_precision=DOT_PRECISION), (BLOCK_M, BLOCK_N, BLOCK_D))
        if HAS_NORM:
            dx -= d_norm[:, :, None] * x
        tl.store(d_blocks + dx_at + cols[None, None, :], dx.to(d_blocks.dtype.element_ty),
                 mask=dx_ok & col_ok[None, None, :])
        dq = tl.dot(tl.trans(d_dot_flat), tl.reshape(x, (BLOCK_M * BLOCK_N, BLOCK_D)), input_precision=DOT_PRECISION)
        tl.store(d_queries_part + (tile * S + qry[:, None]) * D + cols[None, :], dq,
                 mask=(qry < S)[:, None] & col_ok[None, :])


def _pointer_table(blocks: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in blocks], dtype=torch.int64, device=blocks[0].device)


def phase1_forward_launch(queries: torch.Tensor, eps: float | None, blocks: list[torch.Tensor], gpu: bool):
    """The forward launch and its outputs (o (S, M, d), m, l (S, M, H), scores (S, N, M, H), all fp32)."""
    S, H, HD = queries.shape
    N = len(blocks)
    M = blocks[0].numel() // (H * HD)
    f32 = dict(dtype=torch.float32, device=blocks[0].device)
    o = torch.empty(S, M, H * HD, **f32)
    m, l = torch.empty(S, M, H, **f32), torch.empty(S, M, H, **f32)
    scores = torch.empty(S, N, M, H, **f32)
    constexprs, num_warps = phase1_tiles(M, HD, N, S, gpu, backward=False)
    launch = Launch(_phase1_fwd, (triton.cdiv(M, constexprs["BLOCK_M"]), H),
                    (_pointer_table(blocks), blocks[0], queries.float().contiguous(), o, m, l, scores,
                     M, N, S, H, HD, eps or 0.0),
                    dict(HAS_NORM=eps is not None, DOT_PRECISION=dot_precision(blocks[0].dtype), **constexprs),
                    num_warps)
    return launch, (o, m, l, scores)


def phase1_backward_launch(queries: torch.Tensor, eps: float | None, blocks: list[torch.Tensor],
                           d_o: torch.Tensor, d_m: torch.Tensor, d_l: torch.Tensor, gpu: bool):
    """The backward launch and its outputs: d_blocks (N, M, d) in the blocks' dtype and per-tile query
    gradients (tiles, S, d) fp32, summed by the caller (deterministic, unlike atomics)."""
    S, H, HD = queries.shape
    N = len(blocks)
    M = blocks[0].numel() // (H * HD)
    constexprs, num_warps = phase1_tiles(M, HD, N, S, gpu, backward=True)
    n_tiles = triton.cdiv(M, constexprs["BLOCK_M"])
    d_blocks = torch.empty(N, M, H * HD, dtype=blocks[0].dtype, device=blocks[0].device)
    d_queries_part = torch.empty(n_tiles, S, H * HD, dtype=torch.float32, device=blocks[0].device)
    launch = Launch(_phase1_bwd, (n_tiles, H),
                    (_pointer_table(blocks), blocks[0], queries.float().contiguous(), d_o.float().contiguous(),
                     d_m.float().contiguous(), d_l.float().contiguous(), d_blocks, d_queries_part,
                     M, N, S, H, HD, eps or 0.0),
                    dict(HAS_NORM=eps is not None, DOT_PRECISION=dot_precision(blocks[0].dtype), **constexprs),
                    num_warps)
    return launch, (d_blocks, d_queries_part)


class Phase1(torch.autograd.Function):
    """queries (S, H, HD), eps (None: no key norm), blocks N x (B, T, d) -> o, m, l, scores (see reference.phase1)."""

    @staticmethod
    def forward(ctx, queries: torch.Tensor, eps: float | None, *blocks: torch.Tensor):
        S, H, HD = queries.shape
        N, shape = len(blocks), blocks[0].shape
        if any(b.dtype != blocks[0].dtype or b.shape != shape for b in blocks) or shape[-1] != H * HD:
            raise ValueError(f"phase-1 blocks must share one shape and dtype with width H*HD={H * HD}")
        launch, (o, m, l, scores) = phase1_forward_launch(queries, eps, [b.contiguous() for b in blocks],
                                                          compiled_for_gpu(blocks[0].device))
        launch.run()
        ctx.eps = eps
        ctx.save_for_backward(queries, *blocks)
        ctx.mark_non_differentiable(scores)
        tokens = shape[:-1]
        return (o.view(S, *shape), m.view(S, *tokens, H), l.view(S, *tokens, H),
                scores.view(S, N, *tokens, H))

    @staticmethod
    @once_differentiable
    def backward(ctx, d_o, d_m, d_l, _d_scores):
        queries, *blocks = ctx.saved_tensors
        S, H, HD = queries.shape
        N, shape = len(blocks), blocks[0].shape
        launch, (d_blocks, d_queries_part) = phase1_backward_launch(
            queries, ctx.eps, [b.contiguous() for b in blocks], d_o, d_m, d_l, compiled_for_gpu(blocks[0].device))
        launch.run()
        d_queries = d_queries_part.sum(0).view(S, H, HD).to(queries.dtype)
        return (d_queries, None, *d_blocks.view(N, *shape).unbind(0))


def phase1(blocks: list[torch.Tensor], queries: torch.Tensor, eps: float | None):
    """Softmax phase 1 with the key norm fused; returns (o, m, l, scores) like reference.phase1.
    The scores come out of the forward kernel for diagnostics and carry no gradient."""
    # One element type per launch: a block of another dtype (the fp32 embedding among bf16 block sums
    # under autocast) is cast to the newest block's, a copy per call.
    dtype = blocks[-1].dtype
    return Phase1.apply(queries, eps, *(b if b.dtype == dtype else b.to(dtype) for b in blocks))


# -- phase 2: one sublayer's query against the partial sum, merged with phase 1 --------------------


@triton.jit
def _partial_weights(x_dot_q, sum_sq, m1, l1, HD, eps, HAS_NORM: tl.constexpr):
    """Online-softmax merge weights: h = w1 o1 + w2 partial, normalised over both phases."""
    inv = _inverse_rms(sum_sq, HD, eps, HAS_NORM)
    score = x_dot_q * inv
    m = tl.maximum(m1, score)
    a1, a2 = tl.exp(m1 - m), tl.exp(score - m)
    total = a1 * l1 + a2
    return inv, score, a1 / total, a2 / total


@triton.jit
def _phase2_fwd(o1, m1, l1, partial, query, h, scores_out, M, H, HD, eps,
                HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1)
    D = H * HD
    rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    chunk = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    stat = rows * H + head  # into (M, H)
    m_1 = tl.load(m1 + stat, mask=row_ok, other=0.0)
    l_1 = tl.load(l1 + stat, mask=row_ok, other=1.0)

    x_dot_q = tl.zeros((BLOCK_M,), tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), tl.float32)
    for start in range(0, HD, BLOCK_D):
        col_ok = start + chunk < HD
        cols = head * HD + start + chunk
        at, ok = rows[:, None] * D + cols[None, :], row_ok[:, None] & col_ok[None, :]
        x = tl.load(partial + at, mask=ok, other=0.0).to(tl.float32)
        q = tl.load(query + cols, mask=col_ok, other=0.0).to(tl.float32)
        x_dot_q += tl.sum(x * q[None, :], axis=1)
        sum_sq += tl.sum(x * x, axis=1)
    inv, score, w1, w2 = _partial_weights(x_dot_q, sum_sq, m_1, l_1, HD, eps, HAS_NORM)
    tl.store(scores_out + stat, score, mask=row_ok)

    for start in range(0, HD, BLOCK_D):
        col_ok = start + chunk < HD
        cols = head * HD + start + chunk
        at, ok = rows[:, None] * D + cols[None, :], row_ok[:, None] & col_ok[None, :]
        x = tl.load(partial + at, mask=ok, other=0.0).to(tl.float32)
        o = tl.load(o1 + at, mask=ok, other=0.0)
        tl.store(h + at, (w1[:, None] * o + w2[:, None] * x).to(h.dtype.element_ty), mask=ok)


@triton.jit
def _phase2_bwd(o1, m1, l1, partial, query, d_h, d_o1, d_m1, d_l1, d_partial, d_query_part, M, H, HD, eps,
                HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1)
    D = H * HD
    rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    chunk = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    stat = rows * H + head
    m_1 = tl.load(m1 + stat, mask=row_ok, other=0.0)
    l_1 = tl.load(l1 + stat, mask=row_ok, other=1.0)

    x_dot_q = tl.zeros((BLOCK_M,), tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), tl.float32)
    dh_dot_o1 = tl.zeros((BLOCK_M,), tl.float32)
    dh_dot_x = tl.zeros((BLOCK_M,), tl.float32)
    for start in range(0, HD, BLOCK_D):
        col_ok = start + chunk < HD
        cols = head * HD + start + chunk
        at, ok = rows[:, None] * D + cols[None, :], row_ok[:, None] & col_ok[None, :]
        x = tl.load(partial + at, mask=ok, other=0.0).to(tl.float32)
        q = tl.load(query + cols, mask=col_ok, other=0.0).to(tl.float32)
        dh = tl.load(d_h + at, mask=ok, other=0.0).to(tl.float32)
        o = tl.load(o1 + at, mask=ok, other=0.0)
        x_dot_q += tl.sum(x * q[None, :], axis=1)
        sum_sq += tl.sum(x * x, axis=1)
        dh_dot_o1 += tl.sum(dh * o, axis=1)
        dh_dot_x += tl.sum(dh * x, axis=1)
    inv, score, w1, w2 = _partial_weights(x_dot_q, sum_sq, m_1, l_1, HD, eps, HAS_NORM)
    # h = (a1 o1 + a2 x) / (a1 l1 + a2) with a1 = e^(m1-m), a2 = e^(score-m); h does not depend on m.
    dh_dot_h = w1 * dh_dot_o1 + w2 * dh_dot_x
    tl.store(d_m1 + stat, w1 * (dh_dot_o1 - l_1 * dh_dot_h), mask=row_ok)
    tl.store(d_l1 + stat, -w1 * dh_dot_h, mask=row_ok)
    d_score = w2 * (dh_dot_x - dh_dot_h)
    d_dot = d_score * inv  # gradient of x . q
    if HAS_NORM:
        d_norm = d_score * x_dot_q * inv * inv * inv / HD

    for start in range(0, HD, BLOCK_D):
        col_ok = start + chunk < HD
        cols = head * HD + start + chunk
        at, ok = rows[:, None] * D + cols[None, :], row_ok[:, None] & col_ok[None, :]
        x = tl.load(partial + at, mask=ok, other=0.0).to(tl.float32)
        q = tl.load(query + cols, mask=col_ok, other=0.0).to(tl.float32)
        dh = tl.load(d_h + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(d_o1 + at, w1[:, None] * dh, mask=ok)
        dx = w2[:, None] * dh + d_dot[:, None] * q[None, :]
        if HAS_NORM:
            dx -= d_norm[:, None] * x
        tl.store(d_partial + at, dx.to(d_partial.dtype.element_ty), mask=ok)
        tl.store(d_query_part + tile * D + cols, tl.sum(d_dot[:, None] * x, axis=0), mask=col_ok)


def phase2_forward_launch(o1, m1, l1, partial: torch.Tensor, query: torch.Tensor, eps: float | None, gpu: bool):
    """The forward launch and its outputs: h in the partial sum's dtype and the scores (M, H) fp32."""
    H, HD = query.shape
    M = partial.numel() // (H * HD)
    h = torch.empty_like(partial, memory_format=torch.contiguous_format)
    scores = torch.empty(M, H, dtype=torch.float32, device=partial.device)
    constexprs, num_warps = phase2_tiles(M, HD, gpu)
    launch = Launch(_phase2_fwd, (triton.cdiv(M, constexprs["BLOCK_M"]), H),
                    (o1.contiguous(), m1.contiguous(), l1.contiguous(), partial.contiguous(),
                     query.float().contiguous(), h, scores, M, H, HD, eps or 0.0),
                    dict(HAS_NORM=eps is not None, **constexprs), num_warps)
    return launch, (h, scores)


def phase2_backward_launch(o1, m1, l1, partial: torch.Tensor, query: torch.Tensor, d_h: torch.Tensor,
                           eps: float | None, gpu: bool):
    """The backward launch and its outputs: d_o1, d_m1, d_l1 fp32, d_partial in its dtype and per-tile
    query gradients (tiles, d) fp32, summed by the caller."""
    H, HD = query.shape
    M = partial.numel() // (H * HD)
    constexprs, num_warps = phase2_tiles(M, HD, gpu)
    n_tiles = triton.cdiv(M, constexprs["BLOCK_M"])
    d_o1 = torch.empty(o1.shape, dtype=torch.float32, device=o1.device)
    d_m1 = torch.empty(m1.shape, dtype=torch.float32, device=m1.device)
    d_l1 = torch.empty(l1.shape, dtype=torch.float32, device=l1.device)
    d_partial = torch.empty(partial.shape, dtype=partial.dtype, device=partial.device)
    d_query_part = torch.empty(n_tiles, H * HD, dtype=torch.float32, device=partial.device)
    launch = Launch(_phase2_bwd, (n_tiles, H),
                    (o1.contiguous(), m1.contiguous(), l1.contiguous(), partial.contiguous(),
                     query.float().contiguous(), d_h.contiguous(), d_o1, d_m1, d_l1, d_partial, d_query_part,
                     M, H, HD, eps or 0.0),
                    dict(HAS_NORM=eps is not None, **constexprs), num_warps)
    return launch, (d_o1, d_m1, d_l1, d_partial, d_query_part)


class Phase2(torch.autograd.Function):
    """o1 (B, T, d) fp32, m1, l1 (B, T, H), partial (B, T, d), query (H, HD), eps -> h, scores (1, B, T, H)."""

    @staticmethod
    def forward(ctx, o1, m1, l1, partial, query, eps: float | None):
        H = query.shape[0]
        launch, (h, scores) = phase2_forward_launch(o1, m1, l1, partial, query, eps, compiled_for_gpu(partial.device))
        launch.run()
        ctx.eps = eps
        ctx.save_for_backward(o1, m1, l1, partial, query)
        ctx.mark_non_differentiable(scores)
        return h, scores.view(1, *partial.shape[:-1], H)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_h, _d_scores):
        o1, m1, l1, partial, query = ctx.saved_tensors
        launch, (d_o1, d_m1, d_l1, d_partial, d_query_part) = phase2_backward_launch(
            o1, m1, l1, partial, query, d_h, ctx.eps, compiled_for_gpu(partial.device))
        launch.run()
        d_query = d_query_part.sum(0).view(query.shape).to(query.dtype)
        return d_o1.to(o1.dtype), d_m1.to(m1.dtype), d_l1.to(l1.dtype), d_partial, d_query, None


def phase2(o1, m1, l1, partial: torch.Tensor, query: torch.Tensor, eps: float | None):
    """Softmax phase 2 with the key norm fused; returns (h, scores) like reference.phase2.
    The scores are for diagnostics and carry no gradient."""
    return Phase2.apply(o1, m1, l1, partial, query, eps)
