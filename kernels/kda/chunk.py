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

# Pairs inside one sub-chunk get their decay exp(G_t - G_j) computed pair by pair; pairs across
# sub-chunks factor through the start of the later one, which keeps every exponent <= 0 (no overflow)
# and avoids a (C, C, K) tensor.
SUB_CHUNK = 16


def _decayed_gram(rows: torch.Tensor, cols: torch.Tensor, g_cum: torch.Tensor, sub: int,
                  include_diagonal: bool) -> torch.Tensor:
    """sum_c rows[t, c] cols[j, c] exp(g_cum[t, c] - g_cum[j, c]) for j < t (j <= t when include_diagonal),
    zero above. rows, cols, g_cum: (..., C, K) with g_cum non-increasing along C. Returns (..., C, C)."""
    *batch, C, K = rows.shape
    n_sub = C // sub
    position = torch.arange(C, device=rows.device)

    # Across sub-chunks: reference r = first position of the row's sub-chunk, so j < r <= t.
    g_ref = g_cum[..., ::sub, :]  # (..., n_sub, K)
    rows_sub = rows.reshape(*batch, n_sub, sub, K)  # (..., n_sub, sub, K)
    g_sub = g_cum.reshape(*batch, n_sub, sub, K)  # (..., n_sub, sub, K)
    rows_to_ref = rows_sub * (g_sub - g_ref.unsqueeze(-2)).exp()  # (..., n_sub, sub, K)
    col_before_ref = position.unsqueeze(0) < position[::sub].unsqueeze(1)  # (n_sub, C)
    ref_minus_col = g_ref.unsqueeze(-2) - g_cum.unsqueeze(-3)  # (..., n_sub, C, K)
    ref_minus_col = ref_minus_col.masked_fill(~col_before_ref.unsqueeze(-1), float("-inf"))
    cols_from_ref = cols.unsqueeze(-3) * ref_minus_col.exp()  # (..., n_sub, C, K)
    across = rows_to_ref @ cols_from_ref.transpose(-1, -2)  # (..., n_sub, sub, C)
    across = across.reshape(*batch, C, C)  # (..., C, C)

    # Within a sub-chunk: pairwise, exponent masked before exp so the upper triangle cannot overflow.
    in_sub = torch.ones(sub, sub, dtype=torch.bool, device=rows.device).tril(0 if include_diagonal else -1)
    pair_log_decay = g_sub.unsqueeze(-2) - g_sub.unsqueeze(-3)  # (..., n_sub, sub, sub, K)
    pair_decay = pair_log_decay.masked_fill(~in_sub.unsqueeze(-1), float("-inf")).exp()
    cols_sub = cols.reshape(*batch, n_sub, sub, K)  # (..., n_sub, sub, K)
    # Elementwise then sum: a three-operand einsum here lowers to tiny batched matmuls on CPU.
    within = (rows_sub.unsqueeze(-2) * cols_sub.unsqueeze(-3) * pair_decay).sum(-1)  # (..., n_sub, sub, sub)
    same_sub = torch.eye(n_sub, dtype=within.dtype, device=rows.device)  # places block a at (a, a)
    within = (within.unsqueeze(-2) * same_sub.view(n_sub, 1, n_sub, 1)).reshape(*batch, C, C)  # (..., C, C)
    return across + within


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
        x = x.to(compute).transpose(1, 2)  # (B, H, T, D)
        x = F.pad(x, (0, 0, 0, pad))  # (B, H, N*C, D)
        return x.reshape(B, H, n_chunks, C, x.shape[-1])  # (B, H, N, C, D)

    q, k, v, g = to_chunks(q * scale), to_chunks(k), to_chunks(v), to_chunks(g)
    beta = to_chunks(beta.unsqueeze(-1))  # (B, H, N, C, 1)

    g_cum = g.cumsum(dim=-2)  # (B, H, N, C, K): log decay from the chunk start, inclusive
    g_end = g_cum[..., -1:, :]  # (B, H, N, 1, K)
    sub = math.gcd(C, SUB_CHUNK)
    k_gram = _decayed_gram(k, k, g_cum, sub, include_diagonal=False)  # (B, H, N, C, C)
    qk_gram = _decayed_gram(q, k, g_cum, sub, include_diagonal=True)  # (B, H, N, C, C)

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
    for n in range(n_chunks):
        u = u_free[:, :, n] - w[:, :, n] @ state  # (B, H, C, V)
        outputs.append(q_from_start[:, :, n] @ state + qk_gram[:, :, n] @ u)  # (B, H, C, V)
        state = chunk_decay[:, :, n] * state + k_to_end[:, :, n].transpose(-1, -2) @ u  # (B, H, K, V)

    o = torch.stack(outputs, dim=2).reshape(B, H, n_chunks * C, V)[:, :, :T]  # (B, H, T, V)
    o = o.transpose(1, 2).to(out_dtype)  # (B, T, H, V)
    return o, (state if output_final_state else None)
