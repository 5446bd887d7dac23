"""The KDA layer: full-sequence path against decode and chunked prefill with its cache, causality, gradients; K3's
gates against the layer written out."""
import pytest
import torch
import torch.nn.functional as F

from kernels.kda import kda_recurrent
from model.config import KDAConfig, ModelConfig
from model.init import initialise
from model.kda import KimiDeltaAttention, forget_gate

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


# -- K3's options: the lower-bounded forget gate, the full-rank output gate, no gate bias ----------------------------

def test_lower_bounded_gate_is_fla_s_and_stays_above_the_bound():
    """g = lb * sigmoid(exp(A_log) * (f + dt_bias)) (fla's naive_kda_lowerbound_gate): lb/2 where f + dt_bias = 0,
    lb/2 * (1 + tanh(s/2)) with s = exp(A_log) * (f + dt_bias) elsewhere, inside [lb, 0] for any input (at
    either end only where the sigmoid saturates); the unbounded gate falls far below lb."""
    H, K = 2, 3
    A_log = torch.tensor([0.0, 0.5])
    dt_bias = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -1.0])
    f = torch.stack([-dt_bias, torch.full((6,), 1e4), torch.full((6,), -1e4), torch.linspace(-3, 3, 6)])
    g = forget_gate(f.view(1, 4, H * K), A_log, dt_bias, -5.0)[0]  # (4, H, K)
    assert g.shape == (4, H, K) and g.dtype == torch.float32
    torch.testing.assert_close(g[0], torch.full((H, K), -2.5))
    scaled = A_log.exp().view(H, 1) * (f[3] + dt_bias).view(H, K)
    torch.testing.assert_close(g[3], -2.5 * (1 + torch.tanh(scaled / 2)))
    assert (g[1] == -5.0).all() and (g[2] == 0).all()  # saturated at the bound and at no decay
    unbounded = forget_gate(f.view(1, 4, H * K), A_log, dt_bias, None)[0]
    assert unbounded[1].min() < -1000 and (unbounded <= 0).all()


def release_layer(lower_bound: float | None, full_rank: bool, bias: bool) -> KimiDeltaAttention:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=2, init="flat", init_std=0.2,
                      kda=KDAConfig(head_dim=8, chunk_size=16, gate_lower_bound=lower_bound,
                                    full_rank_output_gate=full_rank, output_gate_bias=bias))
    layer = KimiDeltaAttention(cfg)
    initialise(layer, cfg.init_stds, seed=0)
    with torch.no_grad():  # decays and gate biases spread well away from their init
        layer.A_log.copy_(torch.randn(2, generator=torch.Generator().manual_seed(3)))
        layer.dt_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(4)))
        gate = layer.g_proj if full_rank else layer.g_proj[1]
        if bias:
            gate.bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(5)))
    return layer


def plain_kda(p: dict[str, torch.Tensor], x: torch.Tensor, lower_bound: float | None, full_rank: bool) -> torch.Tensor:
    """The layer from its parameters in float64: causal depthwise convs and SiLU, L2-normalised q and k, the
    gate formula written out, the token-by-token recurrence (kernels/kda/reference.py), the per-head RMSNorm
    gated by sigmoid(g_proj(x)), o_proj."""
    B, T, _ = x.shape
    H, K = 2, 8

    def conv(name: str) -> torch.Tensor:
        projected = (x @ p[f"{name}_proj.weight"].T).transpose(1, 2)  # (B, HK, T)
        out = F.conv1d(projected, p[f"{name}_conv1d.weight"], padding=3, groups=H * K)[..., :T]  # (B, HK, T)
        return F.silu(out.transpose(1, 2)).reshape(B, T, H, K)  # (B, T, H, K)

    q, k, v = conv("q"), conv("k"), conv("v")
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    f = ((x @ p["f_proj.0.weight"].T @ p["f_proj.1.weight"].T) + p["dt_bias"]).view(B, T, H, K)
    rate = p["A_log"].exp().view(H, 1)
    g = -rate * F.softplus(f) if lower_bound is None else lower_bound * torch.sigmoid(rate * f)
    beta = torch.sigmoid(x @ p["b_proj.weight"].T)  # (B, T, H)
    o, _ = kda_recurrent(q, k, v, g, beta, K ** -0.5)  # (B, T, H, K)
    o = o * (o.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * p["o_norm.weight"]
    if full_rank:
        gate = x @ p["g_proj.weight"].T
    else:
        gate = x @ p["g_proj.0.weight"].T @ p["g_proj.1.weight"].T
    gate = gate + p.get("g_proj.bias", p.get("g_proj.1.bias", torch.zeros(())))
    return (o * torch.sigmoid(gate).view(B, T, H, K)).reshape(B, T, H * K) @ p["o_proj.weight"].T


@pytest.mark.parametrize("lower_bound, full_rank, bias",
                         [(-5.0, True, False), (-2.0, False, False), (None, True, True)])
def test_release_gates_match_the_written_out_layer_with_every_gradient(lower_bound, full_rank, bias):
    layer = release_layer(lower_bound, full_rank, bias)
    params = dict(layer.named_parameters())
    assert ("g_proj.weight" in params) == full_rank and any(name.endswith(".bias") for name in params) == bias
    x = make_input()
    expected_params = {name: t.detach().double().requires_grad_() for name, t in params.items()}
    expected = plain_kda(expected_params, x.double(), lower_bound, full_rank)
    out = layer(x)
    assert out.abs().max() > 0.05
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    (out * weights).sum().backward()
    (expected * weights.double()).sum().backward()
    for name, p in params.items():
        reference = expected_params[name].grad
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad.double(), reference, atol=1e-4 * reference.abs().max().item(), rtol=1e-3,
                                   msg=name)


@torch.no_grad()
def test_release_gates_decode_like_the_full_sequence():
    layer, x = release_layer(-5.0, True, False), make_input()
    full = layer(x)
    cache = layer.new_cache(x.shape[0], dtype=x.dtype)
    pieces = torch.cat([layer(x[:, :20], cache)] + [layer(x[:, t:t + 1], cache) for t in range(20, T)], dim=1)
    torch.testing.assert_close(pieces, full, atol=1e-5, rtol=1e-4)


def test_lower_bounded_gate_starts_every_head_at_rate_one():
    """As fla's safe_gate layer: A_log = 0, so g = lb * sigmoid(f + dt_bias) at init."""
    cfg = ModelConfig(d_model=32, n_heads=2, kda=KDAConfig(head_dim=8, gate_lower_bound=-5.0))
    layer = KimiDeltaAttention(cfg)
    initialise(layer, cfg.init_stds, seed=0)
    assert torch.equal(layer.A_log, torch.zeros(2))
