"""Plain-torch depth attention for AttnRes: the readable oracle.

Sources are the values attended over depth (the embedding, block sums or single sublayer outputs),
passed as a list of (B, T, d) tensors: stacking them would copy every source at every read, which
costs more than the read itself. Keys are RMSNorm(source) * gain; since
RMSNorm(k) * g . w = rmsnorm(k) . (g * w), callers fold the key-norm gain into the query and pass each
source's inverse RMS, computed once per source instead of once per read. Multi-head depth attention
splits d into H groups, each with its own RMS and score. Statistics are fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

import torch


def _stats(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def inverse_rms(x: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """(..., d) -> (..., H): 1/RMS of each head group."""
    grouped = _stats(x).unflatten(-1, (heads, -1))  # (..., H, d/H)
    return torch.rsqrt(grouped.pow(2).mean(-1) + eps)


def head_columns(queries: torch.Tensor) -> torch.Tensor:
    """(S, H, d/H) learned queries -> (d, S*H) block-diagonal columns: one matmul scores all heads."""
    if queries.shape[1] == 1:  # one head: the columns are the queries themselves
        return queries.flatten(1).t()
    per_query = [torch.block_diag(*q.unsqueeze(-1).unbind(0)) for q in queries.unbind(0)]  # each (d, H)
    return torch.cat(per_query, dim=1)


def depth_scores(sources: list[torch.Tensor], query: torch.Tensor,
                 inv_rms: list[torch.Tensor] | None) -> torch.Tensor:
    """Scores of N sources against one query.

    query (H, d/H) for a learned query or (B, T, H, d/H) for an input-dependent one;
    inv_rms: per source (B, T, H), or None without key norm. Returns (N, B, T, H).
    """
    if query.dim() == 2:
        columns = head_columns(query.unsqueeze(0))  # (d, H)
        scores = [_stats(source @ columns.to(source.dtype)) for source in sources]  # each (B, T, H)
    else:
        scores = [_stats((source.unflatten(-1, query.shape[-2:]) * query.to(source.dtype)).sum(-1))
                  for source in sources]
    if inv_rms is not None:
        scores = [s * r for s, r in zip(scores, inv_rms)]
    return torch.stack(scores)


def source_weights(scores: torch.Tensor, kernel: str) -> torch.Tensor:
    """(N, ...) scores -> weights over the N sources (softmax) or per source (sigmoid)."""
    if kernel == "softmax":
        return torch.softmax(scores, dim=0)
    return torch.sigmoid(scores)


def weighted_sum(weights: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
    """weights (N, B, T, H) (or broadcastable), sources N x (B, T, d) -> sum_i w_i v_i, (B, T, d)."""
    heads = weights.shape[-1]
    out = None
    for weight, source in zip(weights.unbind(0), sources):
        term = (weight.to(source.dtype).unsqueeze(-1) * source.unflatten(-1, (heads, -1))).flatten(-2)
        out = term if out is None else out + term
    return out


def depth_attention(sources: list[torch.Tensor], query: torch.Tensor, inv_rms: list[torch.Tensor] | None,
                    kernel: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """The per-layer read: h = sum_i alpha_i v_i. Returns h (B, T, d) and alpha (N, B, T, H)."""
    weights = source_weights(depth_scores(sources, query, inv_rms), kernel)
    return weighted_sum(weights, sources), weights


def _unnormalised_weights(scores: torch.Tensor, kernel: str):
    """Scores (S, N, B, T, H) -> (p, m, l): softmax numerators e^(s - m) with their max m and sum l over
    the N sources (S, B, T, H); for the sigmoid kernel p = sigmoid(s) and m = l = 0."""
    if kernel == "softmax":
        m = scores.amax(dim=1)  # (S, B, T, H)
        p = torch.exp(scores - m.unsqueeze(1))
        return p, m, p.sum(dim=1)
    zeros = torch.zeros_like(scores[:, 0])
    return torch.sigmoid(scores), zeros, zeros


def phase1(blocks: list[torch.Tensor], queries: torch.Tensor, inv_rms: list[torch.Tensor] | None,
           kernel: str = "softmax"):
    """Inter-block attention for the S queries of one block, reading each block once (Algorithm 1).

    blocks N x (B, T, d); queries (S, H, d/H); inv_rms N x (B, T, H) or None.
    Returns the unnormalised output o (S, B, T, d), the max m (S, B, T, H), the sum l (S, B, T, H) and
    the scores (S, N, B, T, H). For the sigmoid kernel nothing is normalised (m = l = 0): the merge
    is then o1 + o2.
    """
    n_queries, heads = queries.shape[:2]
    columns = head_columns(queries)  # (d, S*H)
    scores = []
    for i, block in enumerate(blocks):
        s = _stats(block @ columns.to(block.dtype)).unflatten(-1, (n_queries, heads))  # (B, T, S, H)
        scores.append(s if inv_rms is None else s * inv_rms[i].unsqueeze(-2))
    scores = torch.stack(scores).movedim(3, 0)  # (S, N, B, T, H)
    p, m, l = _unnormalised_weights(scores, kernel)
    o = None
    for i, block in enumerate(blocks):
        weight = p[:, i].unsqueeze(-1)  # (S, B, T, H, 1)
        term = (weight * _stats(block).unflatten(-1, (heads, -1))).flatten(-2)  # (S, B, T, d)
        o = term if o is None else o + term
    return o, m, l, scores


def _stack(sources: list[torch.Tensor]) -> torch.Tensor:
    """N x (B, T, d) -> (N, B, T, d) in their common dtype (an fp32 embedding among bf16 blocks)."""
    dtype = sources[0].dtype
    for source in sources[1:]:
        dtype = torch.promote_types(dtype, source.dtype)
    return torch.stack([source.to(dtype) for source in sources])


def phase1_stacked(blocks: list[torch.Tensor], queries: torch.Tensor, inv_rms: list[torch.Tensor] | None,
                   kernel: str = "softmax"):
    """`phase1` on the blocks stacked into one tensor: a dozen ops whatever N, instead of a dozen per
    block. Stacking copies every block, so this pays only for few tokens (decoding); same results."""
    n_queries, heads = queries.shape[:2]
    values = _stack(blocks)  # (N, B, T, d)
    scores = _stats(values @ head_columns(queries).to(values.dtype)).unflatten(-1, (n_queries, heads))  # (N, B, T, S, H)
    if inv_rms is not None:
        scores = scores * torch.stack(inv_rms).unsqueeze(-2)
    scores = scores.movedim(3, 0)  # (S, N, B, T, H)
    p, m, l = _unnormalised_weights(scores, kernel)
    grouped = _stats(values).unflatten(-1, (heads, -1))  # (N, B, T, H, d/H)
    o = torch.einsum("snbth,nbthc->sbthc", p, grouped).flatten(-2)  # (S, B, T, d)
    return o, m, l, scores


def depth_attention_stacked(sources: list[torch.Tensor], query: torch.Tensor, inv_rms: list[torch.Tensor] | None,
                            kernel: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """`depth_attention` on the sources stacked into one tensor (few tokens only, as phase1_stacked)."""
    values = _stack(sources)  # (N, B, T, d)
    if query.dim() == 2:
        scores = _stats(values @ head_columns(query.unsqueeze(0)).to(values.dtype))  # (N, B, T, H)
    else:
        scores = _stats((values.unflatten(-1, query.shape[-2:]) * query.to(values.dtype)).sum(-1))  # (N, B, T, H)
    if inv_rms is not None:
        scores = scores * torch.stack(inv_rms)
    weights = source_weights(scores, kernel)  # (N, B, T, H)
    grouped = values.unflatten(-1, (weights.shape[-1], -1))  # (N, B, T, H, d/H)
    h = (weights.to(values.dtype).unsqueeze(-1) * grouped).sum(0).flatten(-2)  # (B, T, d)
    return h, weights


def phase2(o1, m1, l1, partial: torch.Tensor, query: torch.Tensor, inv_rms: torch.Tensor | None,
           kernel: str = "softmax"):
    """Intra-block read of one sublayer: attend over the partial sum and merge with its phase-1 read.

    o1 (B, T, d), m1, l1 (B, T, H) from `phase1`; partial (B, T, d); query (H, d/H) with the key-norm
    gain folded in; inv_rms (B, T, H) of the partial sum, or None without key norm.
    Returns h (B, T, d) in the partial sum's dtype and the partial sum's score (1, B, T, H).
    """
    scores = depth_scores([partial], query, None if inv_rms is None else [inv_rms])  # (1, B, T, H)
    if kernel == "softmax":
        # One source: its own max is its score and its sum is 1.
        h = merge(o1, m1, l1, _stats(partial), scores[0], torch.ones_like(scores[0]), kernel)
    else:
        h = o1 + weighted_sum(torch.sigmoid(scores), [partial]).to(o1.dtype)
    return h.to(partial.dtype), scores


def merge(o1, m1, l1, o2, m2, l2, kernel: str = "softmax"):
    """Online-softmax merge of two partial reads over disjoint source sets.

    o (B, T, d) unnormalised; m, l (B, T, H). Returns the normalised h (B, T, d).
    softmax: m = max(m1, m2); h = (e^{m1-m} o1 + e^{m2-m} o2) / (e^{m1-m} l1 + e^{m2-m} l2).
    """
    if kernel != "softmax":
        return o1 + o2
    heads = m1.shape[-1]
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)  # (B, T, H)
    numerator = (a1.unsqueeze(-1) * o1.unflatten(-1, (heads, -1))
                 + a2.unsqueeze(-1) * o2.unflatten(-1, (heads, -1)))  # (B, T, H, d/H)
    return (numerator / (a1 * l1 + a2 * l2).unsqueeze(-1)).flatten(-2)
