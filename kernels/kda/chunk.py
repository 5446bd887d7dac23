"""Kimi Delta Attention in chunkwise-parallel form (same result as kda_recurrent).

Within a chunk of C tokens starting from state S_0, with G_t the cumulative log decay inside the chunk,
unrolling the recurrence gives S_t = exp(G_t) * S_0 + sum_{j<=t} (exp(G_t - G_j) * k_j) u_j^T, where the
delta-rule updates u_j solve the unit lower-triangular system
    u_t + beta_t sum_{j<t} A_tj u_j = beta_t (v_t - S_0^T (exp(G_t) * k_t)),
    A_tj = sum_c k_t[c] k_j[c] exp(G_t[c] - G_j[c]).
The system's right side is affine in S_0, so the solve (the WY/UT transform) runs for all chunks at
once before the state is known: u = u_free - w S_0. Only the state hand-off loops over chunks.

Resets (document masking): a reset before token s zeroes the state S_{s-1}. Unrolled, token t then sees
S_0 only if no reset lies in [0, t] of its chunk, and update j only if none lies in (j, t]: in every term
above, A_tj (the delta-rule coupling and the output's q-k products) is kept only for j in t's document,
and exp(G_t) S_0 only for the tokens that continue the carried state's document. The decays of the kept
terms involve no decay from before the reset, so masking these terms is exact, not an approximation.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

# Pairs inside one sub-chunk get their decay exp(G_t - G_j) computed pair by pair; pairs across
# sub-chunks factor through the start of the later one, which keeps every exponent <= 0 (no overflow)
# and avoids a (C, C, K) tensor.
SUB_CHUNK = 16


class _DecayedGram(torch.autograd.Function):
    """A_m[t, j] = sum_c rows_m[t, c] cols[j, c] exp(G_t[c] - G_j[c]) for j <= t, zero above, for M row
    sets sharing cols and G. rows: (..., C, M, K); cols, g_cum: (..., C, K) with g_cum non-increasing
    along C. Returns A as (..., C, M, C): A[..., t, m, j] = A_m[t, j].

    For the rows of sub-chunk a, starting at r, columns j < r factor through r:
        A[t, j] = (rows_t * exp(G_t - G_r)) . (cols_j * exp(G_r - G_j)),
    one matmul per sub-chunk. Columns r <= j <= t take exp(G_t - G_j) pair by pair, one row position t
    at a time for all sub-chunks at once. Every exponent is <= 0, and no (C, C, K) or (C, sub, K)
    tensor is materialised: the loops keep the temporaries at (..., C, K) size, which on CPU is what
    makes this fast (full-size temporaries cost more in fresh memory than in arithmetic).

    Backward: with dR, dC the gradients of rows and cols, that of G follows without differentiating the
    decays: dA_tj/dG_t[c] = rows_t[c] dA_tj/drows_t[c] and dA_tj/dG_j[c] = -cols_j[c] dA_tj/dcols_j[c],
    so dG = sum_m rows_m * dR_m - cols * dC. The decays are recomputed rather than saved."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, cols: torch.Tensor, g_cum: torch.Tensor, sub: int) -> torch.Tensor:
        *batch, C, M, K = rows.shape
        n = C // sub
        grams = rows.new_zeros(*batch, C, M, C)
        for r in range(sub, C, sub):  # across: rows [r, r + sub), columns [0, r)
            to_ref, from_ref = _across_decays(g_cum, r, sub)  # (..., sub, K), (..., r, K)
            rows_to_ref = rows[..., r:r + sub, :, :] * to_ref.unsqueeze(-2)  # (..., sub, M, K)
            rows_to_ref = rows_to_ref.view(*batch, sub * M, K)  # (..., sub*M, K)
            cols_from_ref = cols[..., :r, :] * from_ref  # (..., r, K)
            block = rows_to_ref @ cols_from_ref.transpose(-1, -2)  # (..., sub*M, r)
            grams[..., r:r + sub, :, :r] = block.view(*batch, sub, M, r)  # (..., sub, M, r)

        rows_sub = rows.view(*batch, n, sub, M, K)  # (..., n, sub, M, K)
        cols_sub = cols.view(*batch, n, sub, K)  # (..., n, sub, K)
        g_sub = g_cum.view(*batch, n, sub, K)  # (..., n, sub, K)
        within = rows.new_zeros(*batch, n, sub, M, sub)  # (..., n, sub_t, M, sub_j)
        for t in range(sub):  # within: row t of every sub-chunk, its columns j <= t
            cols_pair = cols_sub[..., :t + 1, :] * _pair_decay(g_sub, t)  # (..., n, t+1, K)
            within[..., t, :, :t + 1] = rows_sub[..., t, :, :] @ cols_pair.transpose(-1, -2)  # (..., n, M, t+1)
        _diagonal_blocks(grams, n).add_(within)

        ctx.sub = sub
        ctx.save_for_backward(rows, cols, g_cum)
        return grams

    @staticmethod
    @once_differentiable
    def backward(ctx, d_grams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        rows, cols, g_cum = ctx.saved_tensors
        sub = ctx.sub
        *batch, C, M, K = rows.shape
        n = C // sub
        d_grams = d_grams.contiguous()  # (..., C, M, C)
        d_rows, d_cols = torch.zeros_like(rows), torch.zeros_like(cols)  # (..., C, M, K), (..., C, K)
        for r in range(sub, C, sub):
            to_ref, from_ref = _across_decays(g_cum, r, sub)  # (..., sub, K), (..., r, K)
            rows_to_ref = rows[..., r:r + sub, :, :] * to_ref.unsqueeze(-2)  # (..., sub, M, K)
            rows_to_ref = rows_to_ref.view(*batch, sub * M, K)  # (..., sub*M, K)
            cols_from_ref = cols[..., :r, :] * from_ref  # (..., r, K)
            d_block = d_grams[..., r:r + sub, :, :r].reshape(*batch, sub * M, r)  # (..., sub*M, r)
            d_rows_to_ref = (d_block @ cols_from_ref).view(*batch, sub, M, K)  # (..., sub, M, K)
            d_rows[..., r:r + sub, :, :] += d_rows_to_ref * to_ref.unsqueeze(-2)
            d_cols[..., :r, :] += (d_block.transpose(-1, -2) @ rows_to_ref) * from_ref  # (..., r, K)

        rows_sub = rows.view(*batch, n, sub, M, K)  # (..., n, sub, M, K)
        cols_sub = cols.view(*batch, n, sub, K)  # (..., n, sub, K)
        g_sub = g_cum.view(*batch, n, sub, K)  # (..., n, sub, K)
        d_rows_sub = d_rows.view(*batch, n, sub, M, K)  # (..., n, sub, M, K)
        d_cols_sub = d_cols.view(*batch, n, sub, K)  # (..., n, sub, K)
        d_within = _diagonal_blocks(d_grams, n)  # (..., n, sub_t, M, sub_j)
        for t in range(sub):
            pair = _pair_decay(g_sub, t)  # (..., n, t+1, K)
            d_t = d_within[..., t, :, :t + 1]  # (..., n, M, t+1)
            d_rows_sub[..., t, :, :] += d_t @ (cols_sub[..., :t + 1, :] * pair)  # (..., n, M, K)
            d_cols_sub[..., :t + 1, :] += (d_t.transpose(-1, -2) @ rows_sub[..., t, :, :]) * pair  # (..., n, t+1, K)

        d_g_cum = (rows * d_rows).sum(-2) - cols * d_cols  # (..., C, K)
        return d_rows, d_cols, d_g_cum, None


def _across_decays(g_cum: torch.Tensor, r: int, sub: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the sub-chunk starting at r: exp(G_t - G_r) for r <= t < r + sub, (..., sub, K), and
    exp(G_r - G_j) for j < r, (..., r, K). g_cum: (..., C, K)."""
    g_ref = g_cum[..., r:r + 1, :]  # (..., 1, K)
    return (g_cum[..., r:r + sub, :] - g_ref).exp_(), (g_ref - g_cum[..., :r, :]).exp_()


def _pair_decay(g_sub: torch.Tensor, t: int) -> torch.Tensor:
    """exp(G_t - G_j) for row t and columns j <= t of every sub-chunk. g_sub: (..., n, sub, K) ->
    (..., n, t+1, K)."""
    return (g_sub[..., t:t + 1, :] - g_sub[..., :t + 1, :]).exp_()


def _diagonal_blocks(grams: torch.Tensor, n: int) -> torch.Tensor:
    """The n diagonal (sub, sub) blocks of grams (..., C, M, C) as a view (..., n, sub_t, M, sub_j)."""
    *batch, C, M, _ = grams.shape
    blocks = grams.view(*batch, n, C // n, M, n, C // n)  # (..., n_t, sub_t, M, n_j, sub_j)
    return blocks.diagonal(dim1=-5, dim2=-2).movedim(-1, -4)  # (..., n, sub_t, M, sub_j)


def _document_masks(resets: torch.Tensor, n_chunks: int, C: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """From resets (B, T): same_document (B, 1, N, C, C), 1 where tokens t and j of a chunk are in one
    document, and continues (B, 1, N, C, 1), 1 where token t is in the document of the state the chunk
    starts from (that of the previous chunk's last token; for the first chunk, initial_state's)."""
    B, T = resets.shape
    document = resets.long().cumsum(1)  # (B, T): 0 is initial_state's document
    # Padded tokens continue the last document (they change no state); index 0 is "before token 0".
    document = torch.cat([document.new_zeros(B, 1), document,
                          document[:, -1:].expand(B, n_chunks * C - T)], dim=1)  # (B, 1 + N*C)
    tokens = document[:, 1:].view(B, n_chunks, C)  # (B, N, C)
    carried = document[:, :-1:C]  # (B, N): the document of the token before each chunk
    same_document = tokens.unsqueeze(-1) == tokens.unsqueeze(-2)  # (B, N, C, C)
    continues = tokens == carried.unsqueeze(-1)  # (B, N, C)
    return same_document.to(dtype).unsqueeze(1), continues.to(dtype).view(B, 1, n_chunks, C, 1)


def _decay_from_start(g_cum: torch.Tensor, continues: torch.Tensor | None) -> torch.Tensor:
    """exp(G_t), the decay of the chunk's starting state up to t, zero past a reset. Each caller gets its
    own exp, as before resets existed: one shared tensor would sum its two gradients before the exp's
    backward and change the last bits of every gradient without resets."""
    decay = g_cum.exp()  # (B, H, N, C, K)
    return decay if continues is None else decay * continues


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
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k, g: (B, T, H, K) with g the log decay (<= 0); v: (B, T, H, V); beta: (B, T, H);
    initial_state: (B, H, K, V); resets: (B, T) bool, the state is zeroed before each True token (the
    start of a document; True at token 0 drops initial_state). Returns o (B, T, H, V) in q's dtype and
    the final state (B, H, K, V, at least fp32) when asked for."""
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
    continues = None
    if resets is not None:
        same_document, continues = _document_masks(resets, n_chunks, C, compute)
        grams = grams * same_document.unsqueeze(-2)
    k_gram, qk_gram = grams.unbind(-2)  # (B, H, N, C, C) each, diagonal included

    # WY/UT transform: (I + beta A) [u_free, w] = beta [v, exp(G) k]; then u = u_free - w S_0.
    eye = torch.eye(C, dtype=compute, device=q.device)
    system = eye + beta * k_gram.tril(-1)  # (B, H, N, C, C), unit lower triangular
    rhs = beta * torch.cat([v, _decay_from_start(g_cum, continues) * k], dim=-1)  # (B, H, N, C, V+K)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_free, w = solved.split([V, K], dim=-1)  # (B, H, N, C, V), (B, H, N, C, K)

    q_from_start = q * _decay_from_start(g_cum, continues)  # (B, H, N, C, K): reads S_0 decayed up to t
    k_to_end = k * (g_end - g_cum).exp()  # (B, H, N, C, K): writes decayed to the chunk end
    chunk_decay = g_end.squeeze(-2).exp().unsqueeze(-1)  # (B, H, N, K, 1)
    if resets is not None:  # the state handed on holds the chunk's last document only
        k_to_end = k_to_end * same_document[..., -1, :].unsqueeze(-1)
        chunk_decay = chunk_decay * continues[..., -1:, :]

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
