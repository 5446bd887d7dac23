"""Kimi K3's MoE options against plain formulas: the SiTU activation on every expert path and in the gated MLP
(outputs and all gradients), LatentMoE, the released router (grouped top-k, renormalisation, the bias in or
out of the combine weights), and their parameter counts."""
import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig, MoEConfig
from model.init import init_stds, initialise
from model.mlp import GatedActivation, GatedMLP
from model.moe import MoE, _expert_loop_op, grouped_experts
from model.params import config_counts, count_parameters
from trainer.config import ConfigError, load_config

SITU = GatedActivation("situ", 4.0, 25.0)


def situ_formula(gate: torch.Tensor, up: torch.Tensor, beta=4.0, linear_beta=25.0) -> torch.Tensor:
    """The release's SituAndMul, written out: beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)."""
    up = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up


def expert_rows(counts, d=16, inter=16, dtype=torch.float64, seed=0):
    """Rows sorted by expert for `counts` and weight stacks, scaled so that SiTU's gates reach its saturation
    (|gate| up to ~10 against beta 4) and its up projections its bend (linear_beta 25 needs |up| ~ 25)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    E = counts.shape[0]
    x = torch.randn(int(counts.sum()), d, generator=gen, dtype=dtype) * 2
    weights = [torch.randn(E, d, inter, generator=gen, dtype=dtype) * s for s in (1.0, 4.0)]
    weights.append(torch.randn(E, inter, d, generator=gen, dtype=dtype) * 0.3)
    return x, counts, weights


def plain_experts(x, counts, w_gate, w_up, w_down, **betas):
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        x_e = x[start:start + n]
        rows.append(situ_formula(x_e @ w_gate[e], x_e @ w_up[e], **betas) @ w_down[e])
        start += n
    return torch.cat(rows)


def outputs_and_grads(run, x, counts, weights):
    leaves = [t.clone().requires_grad_() for t in (x, *weights)]
    y = run(leaves[0], counts, *leaves[1:])
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return [y.detach(), *(leaf.grad for leaf in leaves)]


def assert_all_close(got, want, **tolerance):
    for name, g, w in zip(["y", "d_x", "d_gate", "d_up", "d_down"], got, want, strict=True):
        torch.testing.assert_close(g, w, msg=name, **tolerance)


@pytest.mark.parametrize("linear_beta", [25.0, None])
@pytest.mark.parametrize("path", ["loop", "gather", "loop_op"])
def test_situ_expert_paths_equal_the_formula_in_float64(path, linear_beta):
    """loop and gather through autograd; loop_op: the custom op torch.compile runs, whose backward is the
    activation's hand-written derivative (GatedActivation.backward)."""
    activation = GatedActivation("situ", 4.0, linear_beta)
    x, counts, weights = expert_rows([3, 0, 5, 2])
    want = outputs_and_grads(lambda *a: plain_experts(*a, linear_beta=linear_beta), x, counts, weights)
    if path == "loop_op":
        run = lambda *a: _expert_loop_op(*a, "situ", 4.0, linear_beta)  # noqa: E731
    else:
        run = lambda *a: grouped_experts(*a, impl=path, activation=activation)  # noqa: E731
    assert_all_close(outputs_and_grads(run, x, counts, weights), want, atol=1e-10, rtol=1e-10)
    assert want[0].abs().max() > 10  # the rows reach the saturating range, where SiTU differs from SwiGLU


def test_situ_grouped_gemm_equals_the_formula():
    """torch._grouped_mm runs fp32 (not fp64) on CPU: the grouped path against the formula in float64."""
    x, counts, weights = expert_rows([3, 0, 5, 2])
    want = outputs_and_grads(plain_experts, x, counts, weights)
    got = outputs_and_grads(lambda *a: grouped_experts(*a, impl="grouped", activation=SITU),
                            x.float(), counts, [w.float() for w in weights])
    assert_all_close([g.double() for g in got], want, atol=2e-4, rtol=1e-4)


def test_swiglu_loop_op_backward_still_equals_autograd():
    x, counts, weights = expert_rows([2, 4, 0], dtype=torch.float64)
    want = outputs_and_grads(lambda *a: grouped_experts(*a, impl="loop"), x, counts, weights)
    got = outputs_and_grads(lambda *a: _expert_loop_op(*a, "swiglu", 4.0, 25.0), x, counts, weights)
    assert_all_close(got, want, atol=1e-12, rtol=1e-12)


def test_situ_runs_in_fp32_and_returns_the_input_dtype():
    gate, up = torch.randn(64, dtype=torch.bfloat16) * 8, torch.randn(64, dtype=torch.bfloat16) * 40
    out = SITU(gate, up)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, situ_formula(gate.float(), up.float()).bfloat16())
    assert not torch.equal(out, situ_formula(gate, up))  # in bf16 throughout it rounds differently


def test_dense_and_shared_mlp_take_situ():
    torch.manual_seed(0)
    mlp = GatedMLP(8, 12, SITU).double()
    initialise(mlp, init_stds("flat", 2.0, d_model=8, n_sublayers=2), seed=0)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    got = mlp(x)
    params = [x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    got_grads = torch.autograd.grad(got.square().sum(), params)
    want = situ_formula(x @ params[1].T, x @ params[2].T) @ params[3].T
    want_grads = torch.autograd.grad(want.square().sum(), params)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)
    cfg = load_config(["model=xs", "model.moe.activation=situ", "model.moe.situ_beta=3.0"]).model
    moe = MoE(cfg)
    assert moe.shared.activation == moe.activation == GatedActivation("situ", 3.0, 25.0)


def make_moe(seed=0, **options) -> MoE:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=8, init="flat", init_std=0.5, moe=MoEConfig(
        n_routed_experts=4, top_k=2, moe_inter=6, n_shared_experts=1, routed_scaling_factor=1.5, **options))
    moe = MoE(cfg)
    initialise(moe, cfg.init_stds, seed)
    return moe


def test_latent_moe_equals_a_per_token_reference_with_all_gradients():
    """z = down(x); the top-k experts in the latent, weighted; RMSNorm(eps 1e-5) of their sum; up; plus the
    shared expert on x (not z). The router scores x in fp32, as the release."""
    moe = make_moe(activation="situ", latent_dim=5, latent_norm=True).double()
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.2, -0.1, 0.0, 0.3]))
        moe.routed_expert_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    params = dict(moe.named_parameters())
    got = moe(x)
    got_grads = torch.autograd.grad((got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum(),
                                    [x, *params.values()])

    rows = []
    all_scores = torch.sigmoid(F.linear(x.reshape(12, 8).float(), params["router.weight"].float()))  # (12, 4)
    for tok, scores in zip(x.reshape(12, 8), all_scores):
        chosen = torch.topk(scores + moe.expert_bias, 2).indices
        w = (scores[chosen] / (scores[chosen].sum() + 1e-20) * 1.5).double()
        z = params["routed_expert_down_proj.weight"] @ tok  # (5,)
        latent = sum(w_e * (situ_formula(z @ params["w_gate"][e], z @ params["w_up"][e]) @ params["w_down"][e])
                     for e, w_e in zip(chosen.tolist(), w))
        normed = latent / torch.sqrt(latent.square().mean() + 1e-5) * params["routed_expert_norm.weight"]
        rows.append(params["routed_expert_up_proj.weight"] @ normed + moe.shared(tok))
    want = torch.stack(rows).view(2, 6, 8)
    want_grads = torch.autograd.grad((want * torch.linspace(-1, 1, want.numel()).view_as(want)).sum(),
                                     [x, *params.values()])
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    for name, g, w in zip(["x", *params], got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10, msg=name)
    assert moe.w_gate.shape == (4, 5, 6) and moe.w_down.shape == (4, 6, 5)  # the experts are latent wide
    assert moe.routed_expert_down_proj.weight.shape == (5, 8) and moe.routed_expert_up_proj.weight.shape == (8, 5)


def test_latent_moe_without_norm_projects_the_sum_straight_up():
    moe = make_moe(latent_dim=3)
    assert moe.routed_expert_norm is None
    x = torch.randn(1, 4, 8)
    with torch.no_grad():
        out = moe(x)
        moe.routed_expert_up_proj.weight.zero_()  # the routed path now adds nothing: only the shared expert
        torch.testing.assert_close(moe(x), moe.shared(x))
    assert not torch.allclose(out, moe.shared(x))


def test_latent_moe_under_bf16_autocast_sums_the_latent_in_fp32():
    """The experts and projections run in bf16 under CPU autocast; their weighted sum is taken in the stream's
    fp32 (the release sums in fp32 too) before the latent norm. Measured 1.2-1.6 u from fp32 over 5 seeds."""
    moe = make_moe(activation="situ", latent_dim=6, latent_norm=True)
    sums = []
    moe.routed_expert_norm.register_forward_hook(lambda module, args, out: sums.append(args[0].dtype))
    x = torch.randn(2, 5, 8, requires_grad=True)
    want = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = moe(x)
    got.float().sum().backward()
    assert sums == [torch.float32, torch.float32]
    assert ((got.float() - want).norm() / want.norm()).item() < 4 * torch.finfo(torch.bfloat16).eps / 2
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in [x, *moe.parameters()])


def route(moe, logits: list[list[float]], bias: list[float]):
    """Route tokens whose router logits are `logits` (x = the logits, router = identity)."""
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(moe.n_experts, moe.router.in_features))
        moe.expert_bias.copy_(torch.tensor(bias))
    x = torch.zeros(len(logits), moe.router.in_features)
    x[:, :moe.n_experts] = torch.tensor(logits)
    ids, weights, _ = moe.route(x)
    return [sorted(row) for row in ids.tolist()], ids, weights


def test_grouped_top_k_keeps_the_groups_with_the_best_two_biased_scores():
    """8 experts in 4 groups of 2, top-2 groups, top-3 experts. Expert 0 has the best single score, but its
    group (0, 1) sums lower than groups (2, 3) and (6, 7), so it is out; a bias lifts group (4, 5) in, past
    (2, 3)."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=8, moe=MoEConfig(n_routed_experts=8, top_k=3, moe_inter=4, n_expert_groups=4,
                                               topk_groups=2))
    moe = MoE(cfg)
    logits = [[4.0, -4.0, 1.5, 1.4, 0.0, 0.0, 2.0, 1.2]]  # sigmoid: groups sum 1.00, 1.62, 1.00, 1.65
    chosen, _, _ = route(moe, logits, [0.0] * 8)
    assert chosen == [[2, 3, 6]]
    chosen, _, _ = route(moe, logits, [0.0, 0.0, 0.0, 0.0, 0.9, 0.9, 0.0, 0.0])
    assert chosen == [[4, 5, 6]]  # group (4, 5) sums 2 * (0.5 + 0.9) = 2.8; (6, 7) stays second
    ungrouped = MoE(ModelConfig(d_model=8, moe=MoEConfig(n_routed_experts=8, top_k=3, moe_inter=4)))
    chosen, _, _ = route(ungrouped, logits, [0.0] * 8)
    assert chosen == [[0, 2, 6]]


def test_grouped_top_k_matches_the_release_rule_on_random_scores():
    """The release's KimiMoEGate selection, written out: group score = sum of the top-2 biased scores, the
    best topk_group groups kept, the other experts' scores -inf, then top-k."""
    torch.manual_seed(1)
    cfg = ModelConfig(d_model=32, moe=MoEConfig(n_routed_experts=32, top_k=6, moe_inter=4, n_expert_groups=8,
                                                topk_groups=3))
    moe = MoE(cfg)
    torch.nn.init.normal_(moe.router.weight)
    torch.nn.init.normal_(moe.expert_bias, std=0.3)
    x = torch.randn(200, 32)
    ids, _, scores = moe.route(x)
    biased = scores + moe.expert_bias
    group_scores = biased.view(200, 8, 4).topk(2, dim=-1)[0].sum(-1)
    mask = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, 3, dim=-1)[1], 1)
    masked = biased.masked_fill(~mask.repeat_interleave(4, dim=1).bool(), float("-inf"))
    want = torch.topk(masked, 6, dim=-1).indices
    assert torch.equal(ids.sort(-1).values, want.sort(-1).values)
    assert not torch.equal(ids.sort(-1).values, torch.topk(biased, 6, dim=-1).indices.sort(-1).values)


def test_bias_enters_the_weights_only_with_bias_in_weights():
    """K3 (and our default): weights from the unbiased scores; Kimi Linear's released code adds the bias
    into the scores in place before gathering them, so its weights are the biased scores, renormalised."""
    logits, bias = [[2.0, 1.0, 0.0, -1.0]], [0.0, 0.0, 0.0, 5.0]
    s = torch.sigmoid(torch.tensor([2.0, -1.0]))
    for bias_in_weights, picked in ((False, s), (True, s + torch.tensor([0.0, 5.0]))):
        moe = make_moe(bias_in_weights=bias_in_weights)
        chosen, ids, weights = route(moe, logits, bias)
        assert chosen == [[0, 3]]  # the bias picks expert 3 either way
        want = picked / picked.sum() * 1.5
        got = weights[0, [ids[0].tolist().index(0), ids[0].tolist().index(3)]]
        torch.testing.assert_close(got, want)
    assert want[1] > 0.8 * 1.5  # biased: expert 3 (score 0.27) takes most of the weight (5.27 / 6.15)


def test_renormalisation_adds_the_release_epsilon_and_can_be_turned_off():
    logits = [[2.0, 1.0, 0.0, -1.0], [-70.0, -71.0, -80.0, -90.0]]
    moe = make_moe()
    _, ids, weights = route(moe, logits, [0.0] * 4)
    torch.testing.assert_close(weights[0].sum(), torch.tensor(1.5))
    tiny = torch.sigmoid(torch.tensor([-70.0, -71.0]))  # ~4e-31: their sum is far below the 1e-20
    want = tiny / (tiny.sum() + 1e-20) * 1.5
    torch.testing.assert_close(weights[1].sort(descending=True).values, want, rtol=1e-6, atol=0)
    assert weights[1].sum() < 1e-9  # without the epsilon the two would sum to 1.5
    off = make_moe(renormalize=False)
    _, ids, weights = route(off, logits, [0.0] * 4)
    torch.testing.assert_close(weights[0].sort(descending=True).values,
                               torch.sigmoid(torch.tensor([2.0, 1.0])) * 1.5)


@pytest.mark.parametrize("options", [
    {"latent_dim": 5}, {"latent_dim": 5, "latent_norm": True}, {"activation": "situ"},
    {"n_expert_groups": 2, "topk_groups": 1, "bias_in_weights": True, "renormalize": False}])
def test_options_count_as_built(options):
    from model import build_model
    cfg = ModelConfig(vocab_size=37, d_model=24, n_blocks=3, n_heads=2, dense_inter=20,
                      moe=MoEConfig(n_routed_experts=4, top_k=2, moe_inter=7, **options))
    counts, built = config_counts(cfg), count_parameters(build_model(cfg, device="meta"))
    assert (counts.total, counts.active) == (built["total"], built["active"])


def test_k3_moe_layer_has_the_released_parameter_count():
    """One K3 MoE layer (d 7168, 896 experts of 3072 in the 3584 latent, 2 shared): 896 x 3 x 3072 x 3584
    experts, router 896 x 7168, shared 3 x 7168 x 6144, latent projections 2 x 7168 x 3584, latent norm 3584
    (issue 56's research notes, from the release's tensor shapes)."""
    cfg = ModelConfig(d_model=7168, moe=MoEConfig(n_routed_experts=896, top_k=16, moe_inter=3072, n_shared_experts=2,
                                                  latent_dim=3584, latent_norm=True, activation="situ"))
    with torch.device("meta"):
        moe = MoE(cfg)
    shapes = {name: tuple(p.shape) for name, p in moe.named_parameters()}
    assert shapes == {"w_gate": (896, 3584, 3072), "w_up": (896, 3584, 3072), "w_down": (896, 3072, 3584),
                      "router.weight": (896, 7168), "routed_expert_down_proj.weight": (3584, 7168),
                      "routed_expert_norm.weight": (3584,), "routed_expert_up_proj.weight": (7168, 3584),
                      "shared.gate_proj.weight": (6144, 7168), "shared.up_proj.weight": (6144, 7168),
                      "shared.down_proj.weight": (7168, 6144)}
    assert sum(p.numel() for p in moe.parameters()) == (896 * 33_030_144 + 6_422_528 + 132_120_576
                                                        + 2 * 25_690_112 + 3_584)


@pytest.mark.parametrize("override, message", [
    ("model.moe.activation=gelu", "model.moe.activation='gelu' is not valid; allowed: swiglu | situ"),
    ("model.moe.n_expert_groups=3", "model.moe.n_expert_groups=3 must be a positive divisor of "
                                    "model.moe.n_routed_experts=4"),
    ("model.moe.topk_groups=2", "model.moe.topk_groups=2 must be in [1, model.moe.n_expert_groups=1]"),
    ("model.moe.n_expert_groups=4", "model.moe.n_expert_groups=4 leaves 1 expert per group; a group scores its "
                                    "two best experts, so give it at least 2 (a divisor of 4 up to 2)"),
    ("model.moe.situ_linear_beta=0", "model.moe.situ_linear_beta=0.0 must be a positive finite number or null "
                                     "(SiTU's up projection left unbounded)"),
    ("model.moe.latent_norm=true", "model.moe.latent_norm=true normalises LatentMoE's latent; set "
                                   "model.moe.latent_dim too"),
])
def test_bad_moe_options_are_one_line(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(["model=xs", override])
    assert str(error.value) == message


def test_group_count_too_small_for_top_k_is_refused():
    with pytest.raises(ConfigError) as error:
        load_config(["model=xs", "model.moe.n_routed_experts=8", "model.moe.n_expert_groups=4",
                     "model.moe.topk_groups=1", "model.moe.top_k=3"])
    assert str(error.value) == "model.moe.top_k=3 exceeds the 2 experts of model.moe.topk_groups=1 groups of 2"
