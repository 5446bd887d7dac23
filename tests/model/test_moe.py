import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig, MoEConfig
from model.init import init_stds, initialise
from model.mlp import GatedMLP
from model.moe import MoE, choose_expert_impl, grouped_experts, padded_rows


def make_moe(d=8, experts=4, top_k=2, inter=6, shared=1, scale=1.0, rate=1e-3, aux=0.0, seed=0) -> MoE:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=d, init="flat", init_std=0.3, moe=MoEConfig(
        n_routed_experts=experts, top_k=top_k, moe_inter=inter, n_shared_experts=shared,
        routed_scaling_factor=scale, bias_update_rate=rate, aux_loss_coef=aux))
    moe = MoE(cfg)
    initialise(moe, cfg.init_stds, seed)
    return moe


def hand_router(moe: MoE) -> None:
    """scores = sigmoid(x[:4]): expert e is scored by feature e."""
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:, :4] = torch.eye(4)


def test_routing_picks_top_k_with_unbiased_weights():
    moe = make_moe(scale=2.5)
    hand_router(moe)
    x = torch.zeros(2, 8)
    x[0, :4] = torch.tensor([2.0, 1.0, 0.0, -1.0])
    x[1, :4] = torch.tensor([-3.0, 0.5, 4.0, 0.0])
    ids, weights, _ = moe.route(x)
    assert [sorted(row) for row in ids.tolist()] == [[0, 1], [1, 2]]
    s = torch.sigmoid
    expected = {
        (0, 0): s(torch.tensor(2.0)) / (s(torch.tensor(2.0)) + s(torch.tensor(1.0))),
        (1, 2): s(torch.tensor(4.0)) / (s(torch.tensor(4.0)) + s(torch.tensor(0.5))),
    }
    for (tok, expert), w in expected.items():
        slot = ids[tok].tolist().index(expert)
        torch.testing.assert_close(weights[tok, slot], 2.5 * w)
    torch.testing.assert_close(weights.sum(-1), torch.full((2,), 2.5))

    # A bias on expert 3 wins it a slot, but its weight still comes from its unbiased score sigmoid(-1).
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    ids, weights, _ = moe.route(x[:1])
    assert sorted(ids[0].tolist()) == [0, 3]
    w3 = s(torch.tensor(-1.0)) / (s(torch.tensor(2.0)) + s(torch.tensor(-1.0)))
    torch.testing.assert_close(weights[0, ids[0].tolist().index(3)], 2.5 * w3)


def test_output_matches_per_token_loop():
    moe = make_moe(d=8, experts=5, top_k=2, scale=1.7)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4]))
    x = torch.randn(3, 7, 8)
    with torch.no_grad():
        out = moe(x)

        reference = torch.empty(21, 8)
        for n, tok in enumerate(x.reshape(21, 8)):
            scores = torch.sigmoid(moe.router.weight @ tok)
            chosen = torch.topk(scores + moe.expert_bias, 2).indices
            w = scores[chosen] / scores[chosen].sum() * 1.7
            y = moe.shared(tok)
            for e, w_e in zip(chosen.tolist(), w):
                hidden = F.silu(tok @ moe.w_gate[e]) * (tok @ moe.w_up[e])
                y = y + w_e * (hidden @ moe.w_down[e])
            reference[n] = y
    torch.testing.assert_close(out, reference.view(3, 7, 8), atol=1e-5, rtol=0)


def test_update_bias_balances_a_skewed_router():
    moe = make_moe(d=8, experts=8, top_k=2, rate=0.02, seed=1)
    with torch.no_grad():
        moe.router.weight[0, 0] = 4.0  # feature 0 is always 1, so expert 0 wins every token
    x = torch.randn(4, 64, 8)
    x[..., 0] = 1.0
    moe.train()

    with torch.no_grad():
        moe(x)
    initial = moe.load_imbalance()
    assert initial > 3.5  # expert 0 takes all 256 of 512 assignments: 4x the mean
    assert moe.load_fraction()[0] > 0.45
    for _ in range(150):
        with torch.no_grad():
            moe(x)
        moe.update_bias()
    assert moe.expert_bias[0] < 0  # overloaded expert pushed down
    with torch.no_grad():
        moe(x)
    final = moe.load_imbalance()
    assert final < 1.6, (initial, final)


def test_update_bias_direction_and_reset():
    moe = make_moe(experts=4, rate=0.1)
    moe.load_counts.copy_(torch.tensor([10, 2, 4, 4]))  # mean 5
    moe.update_bias()
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    assert moe.load_counts.sum() == 0
    moe.update_bias()  # nothing counted: no change
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    assert moe.load_imbalance() == 1.0


def test_counts_only_in_training_and_bias_is_checkpointed():
    moe = make_moe()
    x = torch.randn(2, 5, 8)
    moe.eval()
    moe(x)
    assert moe.load_counts.sum() == 0
    moe.train()
    moe(x)
    assert moe.load_counts.sum() == 2 * 5 * 2
    state = moe.state_dict()
    assert "expert_bias" in state and "load_counts" not in state
    assert "expert_bias" not in dict(moe.named_parameters())
    moe.to(torch.bfloat16)
    assert moe.load_counts.dtype == torch.long  # counts survive a bf16 cast exactly


def test_gradients_reach_router_experts_and_shared():
    moe = make_moe(experts=4, top_k=2)
    x = torch.randn(4, 16, 8)
    moe(x).pow(2).sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0
    for name in ("w_gate", "w_up", "w_down"):
        grad = getattr(moe, name).grad
        assert (grad.flatten(1).abs().sum(1) > 0).all(), name  # every expert got tokens and a gradient
    for p in moe.shared.parameters():
        assert p.grad.abs().sum() > 0


def test_shared_expert_is_swiglu():
    torch.manual_seed(0)
    mlp = GatedMLP(8, 12)
    initialise(mlp, init_stds("flat", 0.3, d_model=8, n_sublayers=2), seed=0)
    x = torch.randn(5, 8)
    expected = (F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), expected)
    assert sum(p.numel() for p in mlp.parameters()) == 3 * 8 * 12
    moe = make_moe(d=8, inter=6, shared=2)
    assert moe.shared.up_proj.weight.shape == (12, 8)


def test_sequence_balance_loss():
    moe = make_moe(experts=4, top_k=2, aux=0.01)
    x = torch.randn(3, 6, 8)
    moe(x)
    with torch.no_grad():
        expected = torch.zeros(())
        for seq in x:
            scores = torch.sigmoid(seq @ moe.router.weight.T)  # (T, E)
            chosen = torch.topk(scores, 2).indices
            f = torch.stack([(chosen == e).sum() for e in range(4)]).float() * 4 / (2 * 6)
            p = (scores / scores.sum(-1, keepdim=True)).mean(0)
            expected += (f * p).sum() / 3
    torch.testing.assert_close(moe.aux_loss, 0.01 * expected)
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    off = make_moe(aux=0.0)
    off(x)
    assert off.aux_loss.item() == 0.0


def expert_rows(counts, d=16, seed=0):
    """Rows sorted by expert for `counts` (E,), and weight stacks with moe_inter 16 (aligned for fp32)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    E = counts.shape[0]
    x = torch.randn(int(counts.sum()), d, generator=gen)
    weights = [torch.randn(E, d, 16, generator=gen) * 0.3, torch.randn(E, d, 16, generator=gen) * 0.3,
               torch.randn(E, 16, d, generator=gen) * 0.3]
    return x, counts, weights


def outputs_and_grads(impl, x, counts, weights):
    leaves = [t.clone().requires_grad_() for t in (x, *weights)]
    y = grouped_experts(leaves[0], counts, *leaves[1:], impl=impl)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    # With no rows the loop leaves the weights out of the graph (grad None); the grouped path gives zeros.
    return [y.detach(), *(torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for leaf in leaves)]


# Uneven groups, an idle expert first, middle and last, one expert taking everything, and no rows at all.
@pytest.mark.parametrize("impl", ["grouped", "gather"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 7, 0, 0], [9, 2, 4, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
def test_sync_free_paths_equal_the_loop(counts, impl):
    """torch._grouped_mm runs on CPU tensors in torch 2.13 (fp32 and bf16): the grouped path's padding,
    offsets and gather are checked here against the loop; its bf16 CUDA kernel in scripts/gpu_check.sh."""
    x, counts, weights = expert_rows(counts)
    loop = outputs_and_grads("loop", x, counts, weights)
    other = outputs_and_grads(impl, x, counts, weights)
    for name, got, want in zip(["y", "d_x", "d_gate", "d_up", "d_down"], other, loop, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


def testpadded_rows_align_every_group_within_a_shape_only_bound():
    destination, offsets, padded_total = padded_rows(torch.tensor([3, 0, 9, 1]), 13, 4)
    assert padded_total == 16 + 4 * 4  # from the row count alone: no host sync to size it
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [4, 4, 16, 32]  # group starts 0, 4, 4, 16: multiples of 4; the last takes the slack
    assert destination.tolist() == [0, 1, 2, *range(4, 13), 16]


@pytest.mark.parametrize("impl", ["grouped", "gather"])
def test_moe_layer_with_sync_free_experts_equals_the_loop(impl):
    moe = make_moe(d=16, experts=5, top_k=2, inter=8, scale=1.7)
    x = torch.randn(3, 7, 16)
    moe.expert_impl = "loop"
    loop = moe(x)
    moe.expert_impl = impl
    torch.testing.assert_close(moe(x), loop, atol=1e-5, rtol=1e-5)


def test_auto_takes_the_loop_on_cpu_but_gathers_for_decode_and_bad_choices_fail_in_one_line():
    x, counts, weights = expert_rows([2, 3])  # 5 rows, 2 experts
    assert choose_expert_impl("auto", x, weights[2]) == "loop"
    assert choose_expert_impl("auto", x.bfloat16(), weights[2].bfloat16()) == "loop"  # grouped: CUDA only
    assert choose_expert_impl("auto", x[:2], weights[2]) == "gather"  # one row per expert at most: decoding
    assert choose_expert_impl("grouped", x, weights[2]) == "grouped"
    with pytest.raises(ValueError, match=r"^expert_impl='fast' is not one of auto \| loop \| grouped \| gather$"):
        choose_expert_impl("fast", x, weights[2])
    unaligned = make_moe(d=8, inter=6)
    unaligned.expert_impl = "grouped"
    with pytest.raises(ValueError, match=r"^expert_impl=grouped needs the experts' width \(8: model.moe.latent_dim if "
                                         r"set, else d_model\) and moe_inter \(6\) to be multiples of 4 \(16 bytes "
                                         r"of torch.float32\); use expert_impl=loop$"):
        unaligned(torch.randn(1, 3, 8))


@pytest.mark.slow
def test_compiled_moe_layer_is_one_graph_and_equals_eager_with_gradients():
    """fullgraph=True turns any graph break into an error: the loop's counts.tolist() must not break the
    graph (under compile it runs as one opaque op), forward and backward."""
    moe = make_moe(d=16, experts=4, top_k=2, inter=8)
    x = torch.randn(2, 9, 16, requires_grad=True)
    moe.expert_impl = "loop"
    leaves = (x, moe.w_gate, moe.w_up, moe.w_down, moe.router.weight)
    eager_out = moe(x)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), leaves)
    torch._dynamo.reset()
    compiled_out = torch.compile(moe, fullgraph=True)(x)
    compiled_grads = torch.autograd.grad(compiled_out.square().sum(), leaves)
    torch.testing.assert_close(compiled_out, eager_out, atol=1e-5, rtol=1e-5)
    for name, got, want in zip(["x", "w_gate", "w_up", "w_down", "router"], compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
