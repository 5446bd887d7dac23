"""AttnRes residual mixers against the paper's formulas, written out naively here."""
import pytest
import torch

from kernels.attnres import STACK_MAX_TOKENS, depth_attention, merge
from model import build_model
from trainer.config import load_config

VOCAB, B, T = 512, 2, 9


def make(variant: str, *overrides: str, seed: int = 0, randomize: bool = True):
    torch.manual_seed(seed)
    model = build_model(load_config(["model=xs", f"variant={variant}", *overrides])).double()
    if randomize:  # zero-init queries would make every read uniform and hide ordering bugs
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".query") or "key_norm" in name or name.endswith(".logits"):
                    p.copy_(torch.randn_like(p))
    return model


def tokens(seed: int = 1, length: int = T):
    return torch.randint(0, VOCAB, (B, length), generator=torch.Generator().manual_seed(seed))


# Up to STACK_MAX_TOKENS tokens the reads stack their sources, above it they read one at a time: both.
LENGTHS = [T, STACK_MAX_TOKENS // B + 1]


def sublayer_fns(model):
    """[(read module, f)] for sublayers 1..L in order."""
    fns = []
    for block in model.layers.values():
        fns.append((block.attn_res, lambda h, b=block: b.attn(b.attn_norm(h))))
        fns.append((block.mlp_res, lambda h, b=block: b.mlp(b.mlp_norm(h))))
    return fns


def naive_read(sources, read):
    """Paper eq.: alpha = softmax_i(w . RMSNorm(v_i)), h = sum alpha_i v_i."""
    values = torch.stack(sources)  # (N, B, T, d)
    scores = (read.key_norm(values) * read.query).sum(-1)  # (N, B, T)
    return (torch.softmax(scores, 0).unsqueeze(-1) * values).sum(0)


def naive_block_forward(model, x, block_size):
    """Block AttnRes from the definition: blocks b_0 = embedding, b_n = sum of block n's outputs."""
    outputs = [model.embed(x)]  # v_0, v_1, ...
    fns = sublayer_fns(model)

    def sources_for(l):
        n_done = (l - 1) // block_size  # completed blocks b_1 .. b_n_done
        blocks = [outputs[0]] + [sum(outputs[1 + j * block_size: 1 + (j + 1) * block_size]) for j in range(n_done)]
        partial = outputs[1 + n_done * block_size: l]
        return blocks + ([sum(partial)] if partial else [])

    for l, (read, f) in enumerate(fns, start=1):
        outputs.append(f(naive_read(sources_for(l), read)))
    h = naive_read(sources_for(len(fns) + 1), model.final_res)
    return model.lm_head(model.norm(h))


def grads(model, x):
    model.zero_grad()
    logits = model(x)
    (logits.pow(2).mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, atol=1e-10):
    la, ga = a
    lb, gb = b
    torch.testing.assert_close(la, lb, atol=atol, rtol=0)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=atol, rtol=0, msg=name)


def test_worked_numbers_from_design():
    values = [torch.tensor([[[10.0]]]), torch.tensor([[[2.0]]])]  # N x (B, T, d=1), raw keys
    h, alpha = depth_attention(values, torch.tensor([[0.3]]), inv_rms=None)
    assert alpha.flatten().tolist() == pytest.approx([0.9168, 0.0832], abs=1e-4)
    assert h.item() == pytest.approx(9.3346, abs=1e-4)
    one = lambda v: torch.tensor([[[v]]])  # noqa: E731
    merged = merge(one(8.5), one(3.0)[..., 0:1].squeeze(-1), one(25.0).squeeze(-1),
                   one(2.0), one(1.5).squeeze(-1), one(5.0).squeeze(-1))
    assert merged.item() == pytest.approx(0.34256, abs=1e-5)


@pytest.mark.parametrize("variant", ["full", "block"])
def test_zero_initialised_queries_give_uniform_average(variant):
    model = make(variant, randomize=False)
    diagnostics = {}
    model(tokens(), diagnostics=diagnostics)
    for sublayer, weights in diagnostics["depth_weights"].items():
        n = len(weights)
        assert list(weights.values()) == pytest.approx([1 / n] * n, abs=1e-12), sublayer


@pytest.mark.parametrize("length", LENGTHS)
def test_full_matches_naive_definition(length):
    model, x = make("full"), tokens(length=length)
    torch.testing.assert_close(model(x), naive_block_forward(model, x, block_size=1), atol=1e-10, rtol=0)


@pytest.mark.parametrize("block_size", [2, 3, 5, 8, 20])
@pytest.mark.parametrize("two_phase", [True, False])
@pytest.mark.parametrize("length", LENGTHS)
def test_block_matches_naive_definition(block_size, two_phase, length):
    model, x = (make("block", f"variant.block_size={block_size}", f"variant.two_phase={two_phase}"),
                tokens(length=length))
    torch.testing.assert_close(model(x), naive_block_forward(model, x, block_size), atol=1e-10, rtol=0)


@pytest.mark.parametrize("two_phase", [True, False])
def test_block_size_one_equals_full(two_phase):
    full = make("full")
    block = make("block", "variant.block_size=1", f"variant.two_phase={two_phase}")
    block.load_state_dict(full.state_dict())  # same parameter names and shapes
    x = tokens()
    assert_same(grads(full, x), grads(block, x))


@pytest.mark.parametrize("overrides", [
    ["variant.block_size=3"],
    ["variant.block_size=4", "variant.kernel=sigmoid"],
    ["variant.block_size=2", "variant.heads=4"],
    ["variant.block_size=3", "variant.key_norm=false"],
])
def test_two_phase_equals_per_layer_read(overrides):
    per_layer = make("block", *overrides, "variant.two_phase=false")
    two_phase = make("block", *overrides, "variant.two_phase=true")
    two_phase.load_state_dict(per_layer.state_dict())
    x = tokens()
    assert_same(grads(per_layer, x), grads(two_phase, x))


@pytest.mark.parametrize("overrides, dtype, batches", [
    (["variant.two_phase=null"], torch.float32, False),  # CPU tensors: the reference, faster read per layer
    (["variant.two_phase=null", "model.kernel_impl=triton"], torch.float32, True),  # fused kernels (interpreted)
    (["variant.two_phase=null", "model.kernel_impl=triton"], torch.float64, False),  # fp64 never takes them
    (["variant.two_phase=null", "model.kernel_impl=triton", "variant.window=2"], torch.float32, False),
    (["variant.two_phase=true"], torch.float32, True),
    (["variant.two_phase=false", "model.kernel_impl=triton"], torch.float32, False),
])
def test_two_phase_null_batches_where_the_fused_kernels_run(overrides, dtype, batches):
    model = build_model(load_config(["model=xs", "variant=block", *overrides]))
    state = model.mixer.start(torch.zeros(B, T, model.cfg.d_model, dtype=dtype))
    assert model.mixer.batches(state) is batches


def test_baseline_equals_plain_prenorm_sum():
    model, x = make("baseline"), tokens()
    h = model.embed(x)
    for _, f in sublayer_fns(model):
        h = h + f(h)
    torch.testing.assert_close(model(x), model.lm_head(model.norm(h)), atol=1e-12, rtol=0)


def test_block_size_covering_all_layers_leaves_embedding_and_one_block():
    model = make("block", "variant.block_size=100")
    diagnostics = {}
    model(tokens(), diagnostics=diagnostics)
    sources = {sublayer: len(w) for sublayer, w in diagnostics["depth_weights"].items()}
    n = model.cfg.n_sublayers
    assert sources == {1: 1, **{l: 2 for l in range(2, n + 2)}}


def test_sliding_window_sees_embedding_plus_last_sources():
    model = make("full", "variant.window=2")
    diagnostics = {}
    model(tokens(), diagnostics=diagnostics)
    n = model.cfg.n_sublayers
    # Source i is v_i; the read before sublayer l sees v_0 and the last two of v_1..v_{l-1}.
    assert sorted(diagnostics["depth_weights"][n + 1]) == [0, n - 1, n]
    assert sorted(diagnostics["depth_weights"][2]) == [0, 1]


def test_input_dependent_query_is_a_scaled_projection_of_the_latest_source():
    """q_l = W_l RMSNorm(v_{l-1}) / d, then the paper's read: Full AttnRes written out naively."""
    model = make("full", "variant.query=input_dependent")
    with torch.no_grad():
        for read, _ in sublayer_fns(model):
            read.query_proj.weight.normal_(std=0.3)
    d = model.cfg.d_model

    def read_of(sources, read):
        query = read.query_proj(read.query_norm(sources[-1])) / d
        values = torch.stack(sources)                                     # (N, B, T, d)
        scores = (read.key_norm(values) * query).sum(-1)                  # (N, B, T)
        return (torch.softmax(scores, 0).unsqueeze(-1) * values).sum(0)

    outputs = [model.embed(tokens())]
    for read, f in sublayer_fns(model):
        outputs.append(f(read_of(outputs, read)))
    final = model.lm_head(model.norm(read_of(outputs, model.final_res)))
    torch.testing.assert_close(model(tokens()), final, atol=1e-10, rtol=0)


@pytest.mark.parametrize("overrides", [
    ["variant=full", "variant.query=input_dependent"],
    ["variant=full", "variant.mixing=static"],
    ["variant=full", "variant.kernel=sigmoid"],
    ["variant=block", "variant.two_phase=false", "variant.mixing=static"],
    ["variant=block", "variant.two_phase=false", "variant.window=2", "variant.heads=2"],
])
def test_ablations_train_every_parameter(overrides):
    torch.manual_seed(0)
    model = build_model(load_config(["model=xs", *overrides]))
    logits = model(tokens())
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    residual = {n: p for n, p in model.named_parameters() if "_res." in n or n.startswith("final_res")}
    assert residual
    missing = [n for n, p in residual.items() if p.grad is None]
    assert not missing


def test_output_magnitude_diagnostics_match_outputs():
    model = make("baseline")
    diagnostics = {}
    model(tokens(), diagnostics=diagnostics)
    assert sorted(diagnostics["output_rms"]) == list(range(1, model.cfg.n_sublayers + 1))
    h = model.embed(tokens())
    read, f = sublayer_fns(model)[0]
    v1 = f(h)
    assert diagnostics["output_rms"][1] == pytest.approx(v1.pow(2).mean().sqrt().item(), rel=1e-9)
