"""Kimi Delta Attention in chunkwise-parallel form (same result as kda_recurrent).

Within a chunk of C tokens starting from state S_0, with G_t the cumulative log decay inside the chunk,
unrolling the recurrence gives S_t = exp(G_t) * S_0 + sum_{j<=t} (exp(G_t - G_j) * k_j) u_j^T, where the
delta-rule updates u_j solve the unit lower-triangular system
    u_t + beta_t sum_{j<t} A_tj u_j = beta_t (v_t - S_0^T (exp(G_t) * k_t)),
    A_tj = sum_c k_t[c] k_j[c] exp(G_t[c] - G_j[c]).
The system's right side is affine in S_0, so the solve (the WY/UT transform) runs for all chunks at
once before the state is known: u = u_free - w S_0. Only the state hand-off loops over chunks.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

# Pairs inside one sub-chunk get their decay exp(G_t - G_j) computed pair by pair; pairs across
# sub-chunks factor through sub-chunk boundaries, which keeps every exponent <= 0 (no overflow)
# and avoids a (C, C, K) tensor.
SUB_CHUNK = 16


def _gram_decays(g_cum: torch.Tensor, sub: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decay factors of _DecayedGram, every exponent <= 0 since g_cum is non-increasing along C.
    g_cum: (..., C, K). With r_a the first and e_a the last position of sub-chunk a, returns
        to_ref (..., C, K):            exp(G_t - G_{r_a}) for t in sub-chunk a,
        from_ref (..., n, C, K):       exp(G_{r_a} - G_j) for j before sub-chunk a, else 0,
                                       as exp(G_{r_a} - G_{e_b}) exp(G_{e_b} - G_j) for j in sub-chunk b < a,
        pair (..., n, sub, sub, K):    exp(G_t - G_j) for j <= t in the same sub-chunk, else 0."""
    *batch, C, K = g_cum.shape
    n = C // sub
    g_sub = g_cum.reshape(*batch, n, sub, K)  # (..., n, sub, K)
    g_first, g_last = g_sub[..., :1, :], g_sub[..., -1:, :]  # (..., n, 1, K) each
    to_ref = (g_sub - g_first).exp().reshape(*batch, C, K)  # (..., C, K)

    earlier = torch.ones(n, n, dtype=torch.bool, device=g_cum.device).tril(-1)  # (n_a, n_b): b < a
    between = g_first.unsqueeze(-3) - g_last.unsqueeze(-4)  # (..., n_a, n_b, 1, K)
    between = between.masked_fill_(~earlier.view(n, n, 1, 1), float("-inf")).exp_()
    to_last = (g_last - g_sub).exp()  # (..., n_b, sub, K)
    from_ref = (between * to_last.unsqueeze(-4)).reshape(*batch, n, C, K)  # (..., n_a, C, K)

    # Masked before exp, in place: the upper triangle's exponents are >= 0 and could overflow.
    in_sub = torch.ones(sub, sub, dtype=torch.bool, device=g_cum.device).tril()  # (sub_t, sub_j): j <= t
    pair = g_sub.unsqueeze(-2) - g_sub.unsqueeze(-3)  # (..., n, sub_t, sub_j, K)
    pair = pair.masked_fill_(~in_sub.unsqueeze(-1), float("-inf")).exp_()
    return to_ref, from_ref, pair


class _DecayedGram(torch.autograd.Function):
    """A_m[t, j] = sum_c rows_m[t, c] cols[j, c] exp(G_t[c] - G_j[c]) for j <= t, zero above, for M row
    sets sharing cols and G. rows: (..., C, M, K); cols, g_cum: (..., C, K) with g_cum non-increasing
    along C. Returns A as (..., C, M, C): A[..., t, m, j] = A_m[t, j].

    Across sub-chunks (j in b < a, t in a) the decay factors through r_a: A = (rows * to_ref) @
    (cols * from_ref)^T, one matmul per row sub-chunk. Within a sub-chunk it is taken pair by pair:
    P[t, j] = cols_j * pair_tj, A[t, :, j] = rows_t @ P[t, j], a matmul per row t.

    Backward: with dR, dC the gradients of rows and cols, those of G follow without differentiating
    the decays: d A_tj / d G_t[c] = rows_t[c] d A_tj / d rows_t[c] and d A_tj / d G_j[c] =
    -cols_j[c] d A_tj / d cols_j[c], so dG = sum_m rows_m * dR_m - cols * dC."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, cols: torch.Tensor, g_cum: torch.Tensor, sub: int) -> torch.Tensor:
        *batch, C, M, K = rows.shape
        n = C // sub
        to_ref, from_ref, pair = _gram_decays(g_cum, sub)
        rows_to_ref = rows * to_ref.unsqueeze(-2)  # (..., C, M, K)
        cols_from_ref = cols.unsqueeze(-3) * from_ref  # (..., n, C, K)
        grams = rows_to_ref.reshape(*batch, n, sub * M, K) @ cols_from_ref.transpose(-1, -2)  # (..., n, sub*M, C)

        cols_pair = cols.reshape(*batch, n, 1, sub, K) * pair  # (..., n, sub_t, sub_j, K)
        within = rows.reshape(*batch, n, sub, M, K) @ cols_pair.transpose(-1, -2)  # (..., n, sub_t, M, sub_j)
        # The diagonal blocks of grams: (..., sub_t, M, sub_j, n) views of block (a, a); zero so far.
        grams.view(*batch, n, sub, M, n, sub).diagonal(dim1=-5, dim2=-2).add_(within.movedim(-4, -1))

        ctx.sub = sub
        ctx.save_for_backward(rows, cols, to_ref, from_ref, pair, rows_to_ref, cols_from_ref, cols_pair)
        return grams.view(*batch, C, M, C)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_grams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        rows, cols, to_ref, from_ref, pair, rows_to_ref, cols_from_ref, cols_pair = ctx.saved_tensors
        sub = ctx.sub
        *batch, C, M, K = rows.shape
        n = C // sub
        d_grams = d_grams.contiguous()  # (..., C, M, C)

        d_blocks = d_grams.view(*batch, n, sub * M, C)  # (..., n, sub*M, C)
        d_rows = (d_blocks @ cols_from_ref).view(*batch, C, M, K) * to_ref.unsqueeze(-2)  # (..., C, M, K)
        d_cols_from_ref = d_blocks.transpose(-1, -2) @ rows_to_ref.view(*batch, n, sub * M, K)  # (..., n, C, K)
        d_cols = (d_cols_from_ref * from_ref).sum(-3)  # (..., C, K)

        # The diagonal blocks of d_grams, (..., n, sub_t, M, sub_j).
        d_within = d_grams.view(*batch, n, sub, M, n, sub).diagonal(dim1=-5, dim2=-2).movedim(-1, -4)
        d_rows += (d_within @ cols_pair).view(*batch, C, M, K)  # (..., n, sub_t, M, K) -> (..., C, M, K)
        d_cols_pair = d_within.transpose(-1, -2) @ rows.view(*batch, n, sub, M, K)  # (..., n, sub_t, sub_j, K)
        d_cols += (d_cols_pair.mul_(pair).sum(-3)).view(*batch, C, K)  # (..., n, sub_j, K) -> (..., C, K)

        d_g_cum = (rows * d_rows).sum(-2) - cols * d_cols  # (..., C, K)
        return d_rows, d_cols, d_g_cum, None


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k, g: (B, T, H, K) with g the log decay (<= 0); v: (B, T, H, V); beta: (B, T, H);
    initial_state: (B, H, K, V). Returns o (B, T, H, V) in q's dtype and the final state
    (B, H, K, V, at least fp32) when asked for."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    out_dtype = q.dtype
    compute = torch.promote_types(out_dtype, torch.float32)
    n_chunks = math.ceil(T / C)
    pad = n_chunks * C - T

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # Padded tokens have k = 0, beta = 0, g = 0: they leave the state untouched.
        # Contiguous: a zero pad keeps the transposed strides, which every later op would inherit.
        x = F.pad(x.to(compute).transpose(1, 2), (0, 0, 0, pad))  # (B, H, N*C, D)
        return x.reshape(B, H, n_chunks, C, x.shape[-1]).contiguous()  # (B, H, N, C, D)

    q, k, v, g = to_chunks(q * scale), to_chunks(k), to_chunks(v), to_chunks(g)
    beta = to_chunks(beta.unsqueeze(-1))  # (B, H, N, C, 1)

    g_cum = g.cumsum(dim=-2)  # (B, H, N, C, K): log decay from the chunk start, inclusive
    g_end = g_cum[..., -1:, :]  # (B, H, N, 1, K)
    sub = math.gcd(C, SUB_CHUNK)
    grams = _DecayedGram.apply(torch.stack([k, q], dim=-2), k, g_cum, sub)  # (B, H, N, C, 2, C)
    k_gram = grams[..., 0, :].tril(-1)  # (B, H, N, C, C)
    qk_gram = grams[..., 1, :]  # (B, H, N, C, C)

    # WY/UT transform: (I + beta A) [u_free, w] = beta [v, exp(G) k]; then u = u_free - w S_0.
    eye = torch.eye(C, dtype=compute, device=q.device)
    system = eye + beta * k_gram  # (B, H, N, C, C), unit lower triangular
    rhs = beta * torch.cat([v, g_cum.exp() * k], dim=-1)  # (B, H, N, C, V+K)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_free, w = solved.split([V, K], dim=-1)  # (B, H, N, C, V), (B, H, N, C, K)

    q_from_start = q * g_cum.exp()  # (B, H, N, C, K): reads S_0 decayed up to t
    k_to_end = k * (g_end - g_cum).exp()  # (B, H, N, C, K): writes decayed to the chunk end
    chunk_decay = g_end.squeeze(-2).exp().unsqueeze(-1)  # (B, H, N, K, 1)

    if initial_state is None:
        state = q.new_zeros(B, H, K, V)
    else:
        state = initial_state.to(compute)
    outputs = []
    # unbind, not indexing: its backward stacks the chunks' gradients instead of one full-size zeros each.
    per_chunk = (t.unbind(2) for t in (u_free, w, q_from_start, qk_gram, k_to_end, chunk_decay))
    for u_free_n, w_n, q_from_start_n, qk_gram_n, k_to_end_n, chunk_decay_n in zip(*per_chunk):
        u = u_free_n - w_n @ state  # (B, H, C, V)
        outputs.append(q_from_start_n @ state + qk_gram_n @ u)  # (B, H, C, V)
        state = chunk_decay_n * state + k_to_end_n.transpose(-1, -2) @ u  # (B, H, K, V)

    o = torch.stack(outputs, dim=2).reshape(B, H, n_chunks * C, V)[:, :, :T]  # (B, H, T, V)
    o = o.transpose(1, 2).to(out_dtype)  # (B, T, H, V)
    return o, (state if output_final_state else None)
