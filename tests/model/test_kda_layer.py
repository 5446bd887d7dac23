"""The KDA layer: full-sequence path against decode and chunked prefill with its cache, causality, gradients."""
import pytest
import torch

from model.config import KDAConfig, ModelConfig
from model.init import initialise
from model.kda import KimiDeltaAttention

T = 45


def make_layer() -> KimiDeltaAttention:
    torch.manual_seed(0)
    # A larger init_std than training's 0.02 so outputs are O(0.1-1) and tolerances mean something.
    cfg = ModelConfig(d_model=32, n_heads=2, init="flat", init_std=0.2, kda=KDAConfig(head_dim=8, chunk_size=16))
    layer = KimiDeltaAttention(cfg)
    initialise(layer, cfg.init_stds, seed=0)
    return layer


def make_input(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, T, 32, generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_token_by_token_decode_matches_full_sequence():
    layer, x = make_layer(), make_input()
    full = layer(x)
    cache = layer.new_cache(x.shape[0], dtype=x.dtype)
    stepped = torch.cat([layer(x[:, t:t + 1], cache) for t in range(T)], dim=1)
    assert full.abs().max() > 0.05
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("split", [1, 20, 32])
@torch.no_grad()
def test_two_chunks_with_a_cache_match_full_sequence(split):
    layer, x = make_layer(), make_input()
    full = layer(x)
    cache = layer.new_cache(x.shape[0], dtype=x.dtype)
    pieces = torch.cat([layer(x[:, :split], cache), layer(x[:, split:], cache)], dim=1)
    torch.testing.assert_close(pieces, full, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_causal():
    layer, x = make_layer(), make_input()
    t = 20
    changed = x.clone()
    changed[:, t + 1:] = torch.randn_like(changed[:, t + 1:])
    out, out_changed = layer(x), layer(changed)
    torch.testing.assert_close(out_changed[:, :t + 1], out[:, :t + 1], atol=1e-6, rtol=0)
    assert not torch.allclose(out_changed[:, t + 1:], out[:, t + 1:])


def test_every_parameter_gets_a_gradient():
    layer, x = make_layer(), make_input()
    layer(x).square().sum().backward()
    for name, param in layer.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().max() > 0, name
