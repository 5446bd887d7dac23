"""Kimi Delta Attention, token by token: the reference the chunked form is tested against, and the
one-token decode step.

Per head, with a state S of shape (K, V):
    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale * q_t)
The per-channel decay scales the K rows first; the delta rule then replaces what the decayed state
predicts for k_t with v_t, by the fraction beta_t. A reset before token t (a document start) zeroes
S_{t-1}: the document starts from the empty state.
"""
from __future__ import annotations

import torch


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k, g: (B, T, H, K) with g the log decay (<= 0); v: (B, T, H, V); beta: (B, T, H);
    initial_state: (B, H, K, V); resets: (B, T) bool, the state is zeroed before each True token.
    Returns o (B, T, H, V) in q's dtype and the final state (B, H, K, V, at least fp32) when asked for."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    compute = torch.promote_types(out_dtype, torch.float32)
    q, k, v, g, beta = (t.to(compute) for t in (q, k, v, g, beta))
    q = q * scale

    if initial_state is None:
        state = q.new_zeros(B, H, K, V)
    else:
        state = initial_state.to(compute)
    keeps = None if resets is None else (~resets).to(compute).view(B, T, 1, 1, 1)
    outputs = []
    for t in range(T):
        if keeps is not None:
            state = state * keeps[:, t]
        state = state * g[:, t].exp().unsqueeze(-1)  # (B, H, K, V): decay the K rows
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], state)  # (B, H, V)
        correction = v[:, t] - predicted  # (B, H, V)
        state = state + torch.einsum("bhk,bhv->bhkv", beta[:, t].unsqueeze(-1) * k[:, t], correction)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))  # (B, H, V)
    o = torch.stack(outputs, dim=1).to(out_dtype)  # (B, T, H, V)
    return o, (state if output_final_state else None)
