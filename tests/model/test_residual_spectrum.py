"""The residual spectrum (paper section 6.2): Highway, HC and DenseFormer against their definitions, and the
depth-mixing matrix M each mixer reports against the sublayer inputs the model actually computed."""
import json

import pytest
import torch

from conftest import fast_train_overrides, launch_job
from model import build_model
from model.residual import DepthTrace
from model.residual.baseline import EmbeddingSkip, HighwayGate
from parallel.dims import init_distributed
from scripts.depth_matrix import semiseparable_rank
from test_mhc import connections, naive_mhc_forward
from test_residual import sublayer_fns, tokens
from trainer.config import load_config
from trainer.trainer import Trainer


def make(*overrides: str, seed: int = 0, norm_eps: float | None = None):
    cfg = load_config(["model=xs", *overrides])
    if norm_eps is not None:
        cfg.model.norm_eps = norm_eps
    return build_model(cfg, seed=seed).double()


def randomise_residual_parameters(model, scale: float = 0.5) -> None:
    """Perturb every depth-mixing parameter so that no read is uniform, no gate constant."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res." in name or name.startswith("final_res."):
                p.add_(scale * torch.randn_like(p))


def share_backbone(model, donor) -> None:
    result = model.load_state_dict(donor.state_dict(), strict=False)
    assert not result.unexpected_keys and all("_res." in key for key in result.missing_keys)


# -- Highway -----------------------------------------------------------------------------------------

def naive_highway_forward(model, x):
    """h <- (1 - g) h + g v with g = sigmoid(W rmsnorm(h) + b) from the sublayer's input, written out."""
    h = model.embed(x)
    for gate, f in sublayer_fns(model):
        normed = h / h.pow(2).mean(-1, keepdim=True).add(gate.eps).sqrt()
        g = torch.sigmoid(normed @ gate.proj.weight.T + gate.proj.bias)
        h = (1 - g) * h + g * f(h)
    return model.lm_head(model.norm(h))


@pytest.mark.parametrize("gate, width", [("scalar", 1), ("elementwise", 96)])
def test_highway_matches_its_definition_with_random_gates(gate, width):
    model = make("variant=highway", f"variant.gate={gate}")
    gates = [m for m in model.modules() if isinstance(m, HighwayGate)]
    assert len(gates) == model.cfg.n_sublayers and all(g.proj.weight.shape == (width, 96) for g in gates)
    randomise_residual_parameters(model)
    x = tokens()
    torch.testing.assert_close(model(x), naive_highway_forward(model, x), atol=1e-10, rtol=0)


@pytest.mark.parametrize("variant", ["highway", "hc", "denseformer", "x0"])
def test_initial_model_computes_the_baselines_function(variant):
    """Highway's g_l = 1/(l+1) keeps the state the running sum / (l+1): equal once the norms' eps is out
    of the way (set to 1e-30 here; at 1e-5 the logits differ by ~1e-3), to the fp32 rounding of the
    norms (they compute in fp32 even for a float64 model). HC (A = I, one-hot reads) and DenseFormer
    (all scalars 1) compute the running sum itself: to float64 rounding."""
    model = make(f"variant={variant}", norm_eps=1e-30)
    baseline = make("variant=baseline", seed=1, norm_eps=1e-30)
    share_backbone(model, baseline)
    x = tokens()
    torch.testing.assert_close(model(x), baseline(x), atol=1e-6 if variant == "highway" else 1e-9, rtol=0)


def test_hc_matches_the_mhc_definition_without_the_projection():
    model = make("variant=hc", "variant.streams=3")
    assert not connections(model)[0].constrained
    randomise_residual_parameters(model, scale=0.3)
    x = tokens()
    torch.testing.assert_close(model(x), naive_mhc_forward(model, x, constrained=False), atol=1e-10, rtol=0)
    mhc = make("variant=mhc", "variant.streams=3")
    mhc.load_state_dict(model.state_dict())
    assert (mhc(x) - model(x)).abs().max() > 1e-3  # Sinkhorn changes what the same parameters compute


def test_denseformer_reads_raw_learned_scalars():
    model = make("variant=denseformer")
    randomise_residual_parameters(model)
    outputs = [model.embed(tokens())]
    for read, f in sublayer_fns(model):
        assert read.scalars.shape == (len(outputs),)
        outputs.append(f(sum(w * v for w, v in zip(read.scalars, outputs))))
    h = sum(w * v for w, v in zip(model.final_res.scalars, outputs))
    torch.testing.assert_close(model(tokens()), model.lm_head(model.norm(h)), atol=1e-10, rtol=0)


# -- x0 ------------------------------------------------------------------------------------------------

def naive_x0_forward(model, x):
    """Each read is lambda_l * (running sum) + mu_l * embedding; the sum itself stays plain."""
    embedding = model.embed(x)
    h = embedding
    for read, f in sublayer_fns(model):
        scale, skip = read.weights
        h = h + f(scale * h + skip * embedding)
    scale, skip = model.final_res.weights
    return model.lm_head(model.norm(scale * h + skip * embedding))


def test_x0_matches_its_definition_with_random_scalars_and_starts_as_the_baseline_exactly():
    model = make("variant=x0")
    reads = [m for m in model.modules() if isinstance(m, EmbeddingSkip)]
    assert len(reads) == model.cfg.n_sublayers + 1
    x = tokens()
    baseline = make("variant=baseline")
    share_backbone(model, baseline)
    assert torch.equal(model(x), baseline(x))  # lambda = 1, mu = 0: bitwise the baseline
    randomise_residual_parameters(model)
    torch.testing.assert_close(model(x), naive_x0_forward(model, x), atol=1e-10, rtol=0)
    assert (model(x) - baseline(x)).abs().max() > 1e-2


def test_x0_matrix_adds_mu_to_the_embedding_column_only():
    """Row l: M[0->l] = lambda_l + mu_l, M[i->l] = lambda_l for 0 < i < l, the same for every token."""
    model, trace = traced("x0")
    m = token_matrices(trace)                           # (tokens, L+1, L+1)
    weights = [read.weights for read, _ in sublayer_fns(model)] + [model.final_res.weights]
    expected = torch.zeros(len(weights), len(weights), dtype=m.dtype)
    for row, (scale, skip) in enumerate(weights):
        expected[row, :row + 1] = scale
        expected[row, 0] = scale + skip
    torch.testing.assert_close(m, expected.expand_as(m), atol=1e-12, rtol=0)


# -- the depth-mixing matrix ---------------------------------------------------------------------------

SPECTRUM = {
    "baseline": ["variant=baseline"],
    "highway": ["variant=highway"],
    "highway-elementwise": ["variant=highway", "variant.gate=elementwise"],
    "x0": ["variant=x0"],
    "full": ["variant=full"],
    "block": ["variant=block", "variant.block_size=3"],
    "block-two-phase-sigmoid": ["variant=block", "variant.block_size=2", "variant.kernel=sigmoid"],
    "block-heads4": ["variant=block", "variant.block_size=2", "variant.heads=4"],
    "full-input-dependent-query": ["variant=full", "variant.query=input_dependent"],
    "full-no-key-norm": ["variant=full", "variant.key_norm=false"],
    "full-static": ["variant=full", "variant.mixing=static"],
    "full-window3": ["variant=full", "variant.window=3"],
    "denseformer": ["variant=denseformer"],
    "mhc": ["variant=mhc", "variant.streams=2"],
    "hc": ["variant=hc", "variant.streams=2"],
}


def traced(name: str):
    model = make(*SPECTRUM[name])
    randomise_residual_parameters(model)
    trace = DepthTrace(keep_tensors=True)
    with torch.no_grad():
        model(tokens(), trace=trace)
    return model, trace


@pytest.mark.parametrize("name", list(SPECTRUM))
def test_extracted_matrix_reproduces_every_sublayer_input(name):
    """h_l == sum_i M[i->l] v_i for every read, the final one included, on non-trivial parameters."""
    model, trace = traced(name)
    L = model.cfg.n_sublayers
    assert sorted(trace.rows) == list(range(1, L + 2)) and len(trace.outputs) == L + 1
    for sublayer in trace.rows:
        h = trace.inputs[sublayer]
        torch.testing.assert_close(trace.reconstruct(sublayer), h, atol=1e-5 * h.abs().max().item(), rtol=0)


def token_matrices(trace: DepthTrace) -> torch.Tensor:
    return trace.matrix().flatten(0, 2)  # (tokens x groups, L+1, L+1)


def test_baseline_matrix_is_exactly_all_ones_and_rank_one():
    _, trace = traced("baseline")
    m = token_matrices(trace)
    assert torch.equal(m, torch.ones_like(m).tril())
    assert semiseparable_rank(m, 1e-4).tolist() == [1] * m.shape[0]


@pytest.mark.parametrize("name", ["highway", "highway-elementwise"])
def test_highway_matrix_is_one_semiseparable_and_rows_sum_to_one(name):
    _, trace = traced(name)
    m = token_matrices(trace)
    assert m.shape[0] == 2 * 9 * (96 if "elementwise" in name else 1)
    torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1], dtype=m.dtype), atol=1e-12, rtol=0)
    assert semiseparable_rank(m, 1e-4).max() == 1
    assert m.std(0).max() > 1e-3  # input-dependent: tokens get different matrices


@pytest.mark.parametrize("name", ["mhc", "hc"])
def test_stream_matrices_have_semiseparable_rank_at_most_m(name):
    _, trace = traced(name)  # m = 2 streams, L + 1 = 9 rows: blocks up to 5 x 5 could have rank 5
    ranks = semiseparable_rank(token_matrices(trace), 1e-4)
    assert ranks.max() == 2


def test_full_matrix_is_dense_beyond_any_small_rank():
    _, trace = traced("full")
    ranks = semiseparable_rank(token_matrices(trace), 1e-4)
    # 5: the largest lower-left block of a 9 x 9 lower-triangular matrix is 5 x 5; above mHC's bound m = 2
    assert ranks.max() == 5 and ranks.min() > 2 and ranks.double().mean() > 4


def test_block_matrix_is_constant_within_each_completed_block():
    model, trace = traced("block")  # S = 3: blocks {1,2,3}, {4,5,6}, {7,8}
    m = token_matrices(trace)
    for row in range(4, 10):       # reads after block {1,2,3} closed
        assert torch.equal(m[:, row - 1, 1:4], m[:, row - 1, 1:2].expand(-1, 3))
    for row in range(7, 10):
        assert torch.equal(m[:, row - 1, 4:7], m[:, row - 1, 4:5].expand(-1, 3))
    assert (m[:, 8, 7] - m[:, 8, 1]).abs().max() > 1e-3  # different blocks get different weights


# -- training ------------------------------------------------------------------------------------------

def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["highway", "hc"])
def test_trains_and_resumes_exactly(tmp_path, tiny_dataset, variant):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    Trainer(load_config(fast_train_overrides(straight, tiny_dataset, steps=4, variant=variant)), init_distributed()).fit()
    for extra in ({"train.stop_after": 2}, {}):
        overrides = fast_train_overrides(resumed, tiny_dataset, steps=4, variant=variant, **extra)
        Trainer(load_config(overrides), init_distributed()).fit()
    reference = losses(straight)
    assert sorted(reference) == [1, 2, 3, 4] and reference[4] < reference[1]
    assert losses(resumed) == reference


PIPED_VARIANTS = ("highway", "denseformer", "x0", "hc")


@launch_job(2)
def piped_runs(root, dataset):
    return [fast_train_overrides(root / variant, dataset, steps=3, variant=variant, parallel="pp2")
            for variant in PIPED_VARIANTS]


def test_runs_under_pipeline_parallelism_like_one_process(tmp_path, tiny_dataset, launched):
    """highway, denseformer, x0 and HC (its m streams crossing the cut as m tensors) under pp2 (the four
    runs in the session's 2-rank launch): one process's losses."""
    piped = launched(piped_runs)
    for variant in PIPED_VARIANTS:
        straight = tmp_path / variant / "straight"
        Trainer(load_config(fast_train_overrides(straight, tiny_dataset, steps=3, variant=variant)),
                init_distributed()).fit()
        reference, found = losses(straight), losses(piped / variant)
        assert sorted(found) == [1, 2, 3], variant
        for step, loss in found.items():
            assert loss == pytest.approx(reference[step], rel=1e-5), (variant, step)


def test_depth_read_flops_count_every_variants_residual_arithmetic():
    from model.flops import depth_read_flops

    def flops(*overrides):
        return depth_read_flops(load_config(["model=xs", *overrides]).model)

    L, d = 8, 96
    assert flops("variant=baseline") == 0
    assert flops("variant=highway") == L * (2 * d + 3 * d)
    assert flops("variant=highway", "variant.gate=elementwise") == L * (2 * d * d + 3 * d)
    assert flops("variant=x0") == (L + 1) * 3 * d
    assert flops("variant=hc") == flops("variant=mhc") == L * (4 * 4 + 2 * 16) * d
    assert flops("variant=denseformer") == flops("variant=full") > 0
