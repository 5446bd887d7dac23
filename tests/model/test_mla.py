import dataclasses

import pytest
import torch

from model.config import MLAConfig, ModelConfig
from model.init import initialise
from model.mla import MLACache, MultiHeadLatentAttention


def small_cfg() -> ModelConfig:
    # init_std large enough that attention is far from uniform, so the checks below have teeth.
    return ModelConfig(d_model=32, n_heads=4, init="flat", init_std=0.2,
                       mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6))


@pytest.fixture
def attn() -> MultiHeadLatentAttention:
    torch.manual_seed(0)
    cfg = small_cfg()
    attn = MultiHeadLatentAttention(cfg)
    initialise(attn, cfg.init_stds, seed=0)
    return attn.eval()


def test_causal(attn):
    torch.manual_seed(1)
    x = torch.randn(2, 12, 32)
    t = 5
    with torch.no_grad():
        out = attn(x)
        future_changed = x.clone()
        future_changed[:, t + 1:] = torch.randn(2, 12 - t - 1, 32)
        out_future = attn(future_changed)
        past_changed = x.clone()
        past_changed[:, t] = torch.randn(2, 32)
        out_past = attn(past_changed)
    torch.testing.assert_close(out_future[:, :t + 1], out[:, :t + 1], atol=1e-6, rtol=0)
    torch.testing.assert_close(out_past[:, :t], out[:, :t], atol=1e-6, rtol=0)
    # Every later position must see the changed token.
    later_diff = (out_past[:, t:] - out[:, t:]).abs().amax(dim=-1)  # (B, T - t)
    assert (later_diff > 1e-3).all(), later_diff


def test_matches_explicit_attention(attn):
    """Per-head keys are [k_nope_h, shared unrotated slice]; softmax scale is 1/sqrt(nope+rope)."""
    torch.manual_seed(4)
    B, T, H = 2, 6, 4
    x = torch.randn(B, T, 32)
    with torch.no_grad():
        out = attn(x)
        q = (x @ attn.q_proj.weight.T).view(B, T, H, 12)
        kv_a = x @ attn.kv_a_proj.weight.T
        shared = kv_a[..., 16:]  # (B, T, 4)
        kv = (attn.kv_a_norm(kv_a[..., :16]) @ attn.kv_b_proj.weight.T).view(B, T, H, 14)
        k = torch.cat([kv[..., :8], shared.unsqueeze(2).expand(B, T, H, 4)], dim=-1)
        logits = torch.einsum("bthd,bshd->bhts", q, k) / 12 ** 0.5
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads = torch.einsum("bhts,bshd->bthd", logits.softmax(-1), kv[..., 8:]).reshape(B, T, H * 6)
        expected = heads @ attn.o_proj.weight.T
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_decode_token_by_token_matches_full(attn):
    torch.manual_seed(2)
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        full = attn(x)
        cache = attn.new_cache(2, device=x.device, dtype=x.dtype)
        steps = [attn(x[:, i:i + 1], cache) for i in range(10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 10


def test_two_chunk_prefill_matches_full(attn):
    torch.manual_seed(3)
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        full = attn(x)
        cache = attn.new_cache(2, dtype=x.dtype)
        first = attn(x[:, :4], cache)
        second = attn(x[:, 4:], cache)  # 7 queries at absolute positions 4..10
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-5, rtol=0)


def test_cache_holds_only_latent_and_shared_slice(attn):
    assert [f.name for f in dataclasses.fields(MLACache)] == ["latent", "rope"]
    cache = attn.new_cache(3)
    assert cache.latent.shape == (3, 0, 16) and cache.rope.shape == (3, 0, 4)
    with torch.no_grad():
        attn(torch.randn(3, 5, 32), cache)
        attn(torch.randn(3, 1, 32), cache)
    assert cache.latent.shape == (3, 6, 16)  # kv_lora_rank per token
    assert cache.rope.shape == (3, 6, 4)     # one rope slice per token, not per head


def test_cached_latent_is_normalised(attn):
    cache = attn.new_cache(1)
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        attn(x, cache)
        latent = attn.kv_a_proj(x)[..., :16]
    torch.testing.assert_close(cache.latent, attn.kv_a_norm(latent))


def test_parameter_count():
    cfg = small_cfg()
    d, H, r, n, p, v = 32, 4, 16, 8, 4, 6
    expected = (
        d * H * (n + p)      # q_proj
        + d * (r + p)        # kv_a_proj
        + r                  # kv_a_norm weight
        + r * H * (n + v)    # kv_b_proj
        + H * v * d          # o_proj
    )
    model = MultiHeadLatentAttention(cfg)
    assert sum(q.numel() for q in model.parameters()) == expected == 1536 + 640 + 16 + 896 + 768
