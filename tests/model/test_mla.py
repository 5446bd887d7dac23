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


# -- K3's options: the query LoRA, the output gate, the latent norms' eps ------------------------------------------

def release_cfg() -> ModelConfig:
    cfg = small_cfg()
    return dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, q_lora_rank=10, output_gate=True,
                                                            latent_norm_eps=1e-6))


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight


def test_query_lora_and_output_gate_match_the_release_formulas_with_every_gradient():
    """q = q_b(q_a_layernorm(q_a x)); the heads' outputs times sigmoid(g_proj(x)) before o_proj; both latent
    norms at latent_norm_eps: outputs and every parameter's gradient against plain formulas in float64."""
    torch.manual_seed(0)
    cfg = release_cfg()
    attn = MultiHeadLatentAttention(cfg)
    initialise(attn, cfg.init_stds, seed=0)
    attn = attn.double()
    assert attn.kv_a_norm.eps == attn.q_a_layernorm.eps == 1e-6
    B, T, H = 2, 7, 4
    x = torch.randn(B, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    params = dict(attn.named_parameters())
    assert "q_proj.weight" not in params and params["g_proj.weight"].shape == (H * 6, 32)

    def plain(p: dict[str, torch.Tensor]) -> torch.Tensor:
        q = plain_rms_norm(x @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"], 1e-6) @ p["q_b_proj.weight"].T
        q = q.view(B, T, H, 12)
        kv_a = x @ p["kv_a_proj.weight"].T
        kv = (plain_rms_norm(kv_a[..., :16], p["kv_a_norm.weight"], 1e-6) @ p["kv_b_proj.weight"].T).view(B, T, H, 14)
        k = torch.cat([kv[..., :8], kv_a[..., 16:].unsqueeze(2).expand(B, T, H, 4)], dim=-1)
        logits = torch.einsum("bthd,bshd->bhts", q, k) / 12 ** 0.5
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads = torch.einsum("bhts,bshd->bthd", logits.softmax(-1), kv[..., 8:]).reshape(B, T, H * 6)
        return (heads * torch.sigmoid(x @ p["g_proj.weight"].T)) @ p["o_proj.weight"].T

    expected_params = {name: p.detach().clone().requires_grad_() for name, p in params.items()}
    expected = plain(expected_params)
    out = attn(x)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    for name, p in params.items():
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, expected_params[name].grad, atol=1e-12, rtol=0, msg=name)


def test_query_lora_and_output_gate_decode_like_the_full_sequence():
    torch.manual_seed(0)
    cfg = release_cfg()
    attn = MultiHeadLatentAttention(cfg)
    initialise(attn, cfg.init_stds, seed=0)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = attn(x)
        cache = attn.new_cache(2, dtype=x.dtype)
        steps = [attn(x[:, :4], cache)] + [attn(x[:, i:i + 1], cache) for i in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_latent_norm_eps_defaults_to_norm_eps():
    attn = MultiHeadLatentAttention(dataclasses.replace(small_cfg(), norm_eps=3e-5))
    assert attn.kv_a_norm.eps == 3e-5 and attn.g_proj is None


def test_parameter_count_with_query_lora_and_output_gate():
    d, H, r, n, p, v, q = 32, 4, 16, 8, 4, 6, 10
    expected = (d * q + q + q * H * (n + p)  # q_a_proj, q_a_layernorm, q_b_proj
                + d * (r + p) + r + r * H * (n + v)
                + d * H * v                   # g_proj
                + H * v * d)
    assert sum(t.numel() for t in MultiHeadLatentAttention(release_cfg()).parameters()) == expected == 3898
