"""Plain-torch depth attention for AttnRes: the readable oracle.

Notation (paper units): sources are the values attended over depth (the embedding, block sums or
single sublayer outputs). Keys are RMSNorm(source) * gain; since RMSNorm(k) * g . w = rmsnorm(k) . (g * w),
callers fold the key-norm gain into the query and pass each source's inverse RMS, which is computed
once per source instead of once per read. Multi-head depth attention splits d into H groups, each
with its own RMS and score. Softmax statistics are fp32 whatever the activation dtype.
"""
from __future__ import annotations

import torch


def _stats(x: torch.Tensor) -> torch.Tensor:
    """Statistics in fp32, or fp64 when the input is fp64 (tests in double precision)."""
    return x if x.dtype == torch.float64 else x.float()


def inverse_rms(x: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """(..., d) -> (..., H): 1/RMS of each head group, fp32."""
    grouped = _stats(x).unflatten(-1, (heads, -1))  # (..., H, d/H)
    return torch.rsqrt(grouped.pow(2).mean(-1) + eps)


def depth_scores(values: torch.Tensor, query: torch.Tensor, inv_rms: torch.Tensor | None) -> torch.Tensor:
    """Scores of N sources against one query per sublayer.

    values (N, B, T, d); query (H, d/H) for a learned query or (B, T, H, d/H) for an input-dependent one;
    inv_rms (N, B, T, H) or None (no key norm). Returns (N, B, T, H) in fp32.
    """
    heads = query.shape[-2]
    grouped = values.unflatten(-1, (heads, -1))  # (N, B, T, H, d/H)
    if query.dim() == 2:
        scores = _stats(torch.einsum("nbthe,he->nbth", grouped, query.to(values.dtype)))
    else:
        scores = _stats(torch.einsum("nbthe,bthe->nbth", grouped, query.to(values.dtype)))
    return scores if inv_rms is None else scores * inv_rms


def source_weights(scores: torch.Tensor, kernel: str) -> torch.Tensor:
    """(N, ...) scores -> weights over the N sources (softmax) or per source (sigmoid), fp32."""
    if kernel == "softmax":
        return torch.softmax(scores, dim=0)
    return torch.sigmoid(scores)


def weighted_sum(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """weights (N, B, T, H), values (N, B, T, d) -> (B, T, d) in the values' dtype."""
    heads = weights.shape[-1]
    grouped = values.unflatten(-1, (heads, -1))  # (N, B, T, H, d/H)
    mixed = torch.einsum("nbth,nbthe->bthe", weights.to(values.dtype), grouped)
    return mixed.flatten(-2)


def depth_attention(values: torch.Tensor, query: torch.Tensor, inv_rms: torch.Tensor | None,
                    kernel: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """The per-layer read: h = sum_i alpha_i v_i. Returns h (B, T, d) and alpha (N, B, T, H)."""
    weights = source_weights(depth_scores(values, query, inv_rms), kernel)
    return weighted_sum(weights, values), weights


def phase1(blocks: torch.Tensor, queries: torch.Tensor, inv_rms: torch.Tensor | None, kernel: str = "softmax"):
    """Inter-block attention for the S queries of one block, reading each block once (Algorithm 1).

    blocks (N, B, T, d); queries (S, H, d/H); inv_rms (N, B, T, H) or None.
    Returns the unnormalised output o (S, B, T, d) fp32, the max m (S, B, T, H) and the sum l (S, B, T, H).
    For the sigmoid kernel nothing is normalised: m = 0 and l = 0, so the merge reduces to o1 + o2.
    """
    n, heads = blocks.shape[0], queries.shape[-2]
    grouped = blocks.unflatten(-1, (heads, -1))  # (N, B, T, H, d/H)
    scores = _stats(torch.einsum("nbthe,she->snbth", grouped, queries.to(blocks.dtype)))  # (S, N, B, T, H)
    if inv_rms is not None:
        scores = scores * inv_rms
    if kernel == "softmax":
        m = scores.amax(dim=1)  # (S, B, T, H)
        p = torch.exp(scores - m.unsqueeze(1))
        l = p.sum(dim=1)
    else:
        p = torch.sigmoid(scores)
        m = l = torch.zeros_like(scores[:, 0])
    o = torch.einsum("snbth,nbthe->sbthe", p, _stats(grouped)).flatten(-2)  # (S, B, T, d)
    return o, m, l, scores


def merge(o1, m1, l1, o2, m2, l2, kernel: str = "softmax"):
    """Online-softmax merge of two partial reads over disjoint source sets.

    o (B, T, d) unnormalised; m, l (B, T, H). Returns the normalised h (B, T, d) fp32.
    softmax: m = max(m1, m2); h = (e^{m1-m} o1 + e^{m2-m} o2) / (e^{m1-m} l1 + e^{m2-m} l2).
    """
    if kernel != "softmax":
        return o1 + o2
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)  # (B, T, H)
    numerator = a1.unsqueeze(-1) * o1.unflatten(-1, (m.shape[-1], -1)) + a2.unsqueeze(-1) * o2.unflatten(
        -1, (m.shape[-1], -1))  # (B, T, H, d/H)
    return (numerator / (a1 * l1 + a2 * l2).unsqueeze(-1)).flatten(-2)
