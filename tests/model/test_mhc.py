"""mHC (manifold-constrained Hyper-Connections) against its definition, written out naively here.

The reduction rule tested: with every stream initialised to the embedding, the one-hot width
connection alpha_0 = e_{(l-1) mod m}, the all-ones depth connection beta_0 and zero projections, the
streams stay identical, so each sublayer reads the PreNorm running sum and the final stream mean is
h_L: the logits equal the baseline model's with the same weights (A = I forced, and also A = A_0).
"""
import json

import pytest
import torch

from conftest import fast_train_overrides
from model import build_model
from model.residual.mhc import MIX_INIT_LOGIT, StreamConnections, sinkhorn
from parallel.dims import init_distributed
from test_residual import sublayer_fns, tokens
from trainer.config import load_config
from trainer.optim import split_parameters
from trainer.trainer import Trainer


def make(*overrides: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(load_config(["model=xs", *overrides])).double()


def connections(model) -> list[StreamConnections]:
    return [m for m in model.modules() if isinstance(m, StreamConnections)]


def baseline_pair(force_identity_mixing: bool):
    """(mHC model, baseline model) sharing every non-mHC weight."""
    mhc, baseline = make("variant=mhc"), make("variant=baseline", seed=1)
    result = mhc.load_state_dict(baseline.state_dict(), strict=False)
    assert not result.unexpected_keys and all("_res." in key for key in result.missing_keys)
    if force_identity_mixing:
        with torch.no_grad():
            for conn in connections(mhc):
                conn.mix_bias.copy_(1e3 * torch.eye(conn.streams).flatten())  # Sinkhorn: I to within e^-60
    return mhc, baseline


@pytest.mark.parametrize("force_identity_mixing", [True, False])
def test_default_init_reduces_to_the_plain_residual_stream(force_identity_mixing):
    mhc, baseline = baseline_pair(force_identity_mixing)
    x = tokens()
    if force_identity_mixing:
        mix = sinkhorn(connections(mhc)[0].mix_bias.unflatten(0, (-1, mhc.cfg.residual.streams)))
        torch.testing.assert_close(mix, torch.eye(mhc.cfg.residual.streams, dtype=mix.dtype), atol=1e-20, rtol=0)
    h = baseline.embed(x)
    for _, f in sublayer_fns(baseline):  # the naive PreNorm loop
        h = h + f(h)
    naive = baseline.lm_head(baseline.norm(h))
    torch.testing.assert_close(mhc(x), naive, atol=1e-10, rtol=0)
    torch.testing.assert_close(mhc(x), baseline(x), atol=1e-10, rtol=0)


def test_sinkhorn_output_is_doubly_stochastic():
    # Logits around the initial A_0 with per-token perturbations of the size the projection learns.
    noise = 0.5 * torch.randn(100, 20, 4, 4, generator=torch.Generator().manual_seed(0))
    mix = sinkhorn(MIX_INIT_LOGIT * torch.eye(4) + noise)
    assert (mix >= 0).all()
    torch.testing.assert_close(mix.sum(-1), torch.ones(100, 20, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(mix.sum(-2), torch.ones(100, 20, 4), atol=1e-5, rtol=0)


def naive_mhc_forward(model, x, constrained: bool = True):
    """H_l = A_l H_{l-1} + beta_l v_l with per-token alpha, beta, A computed here from the definition
    (Sinkhorn: exp, then 20 rounds of column and row normalisation; HC, unconstrained: A as it is)."""
    m = model.cfg.residual.streams
    e = model.embed(x)
    streams = [e] * m
    for conn, f in sublayer_fns(model):
        mean = sum(streams) / m
        x_norm = mean / mean.pow(2).mean(-1, keepdim=True).add(conn.eps).sqrt()
        dynamic = torch.tanh(x_norm @ conn.proj.weight.T)
        alpha = conn.read_bias + conn.gates[0] * dynamic[..., :m]
        beta = conn.write_bias + conn.gates[1] * dynamic[..., m:2 * m]
        mix = (conn.mix_bias + conn.gates[2] * dynamic[..., 2 * m:]).unflatten(-1, (m, m))
        if constrained:
            mix = torch.exp(mix)
            for _ in range(20):
                mix = mix / mix.sum(-2, keepdim=True)
                mix = mix / mix.sum(-1, keepdim=True)
        v = f(sum(alpha[..., j:j + 1] * streams[j] for j in range(m)))
        streams = [sum(mix[..., k, j:j + 1] * streams[j] for j in range(m)) + beta[..., k:k + 1] * v
                   for k in range(m)]
    return model.lm_head(model.norm(sum(streams) / m))


def test_matches_naive_definition_with_random_connections():
    model = make("variant=mhc", "variant.streams=3")
    with torch.no_grad():
        for conn in connections(model):
            for p in conn.parameters():
                p.add_(0.3 * torch.randn_like(p))
    x = tokens()
    torch.testing.assert_close(model(x), naive_mhc_forward(model, x), atol=1e-10, rtol=0)


def test_every_mhc_parameter_gets_a_gradient():
    model = make("variant=mhc")
    with torch.no_grad():  # as after a first step: with P = 0 exactly, tanh(P x) = 0 leaves the gates no gradient
        for conn in connections(model):
            conn.proj.weight.normal_(std=0.01)
    model(tokens()).logsumexp(-1).mean().backward()
    named = {n: p for n, p in model.named_parameters() if "_res." in n}
    assert len(named) == 5 * model.cfg.n_sublayers  # read/write/mix biases, gates and projection per sublayer
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in named.values())
    for kind in ("read_bias", "write_bias", "mix_bias", "gates", "proj.weight"):
        assert sum(p.grad.abs().sum() for n, p in named.items() if n.endswith(kind)) > 0, kind


def test_connection_biases_and_gates_get_no_weight_decay_nor_muon():
    model = make("variant=mhc")
    muon, decay, no_decay = split_parameters(model, use_muon=True)
    biases = [p for n, p in model.named_parameters() if n.endswith(("read_bias", "write_bias", "mix_bias", "gates"))]
    assert biases and all(any(p is q for q in no_decay) for p in biases)


def test_trains_under_the_trainer(tmp_path, tiny_dataset):
    run = tmp_path / "mhc"
    Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=3, variant="mhc")), init_distributed()).fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] + 0.1


def test_tensor_and_pipeline_parallelism_are_accepted():
    """Under pp the m streams cross each cut as m tensors (tests/parallel/test_pipeline.py); under tp each
    stream is sharded along the sequence like the residual stream (tests/parallel/test_tensor_parallel.py)."""
    assert load_config(["model=xs", "variant=mhc", "parallel=pp2"]).parallel.pp == 2
    assert load_config(["model=xs", "variant=mhc", "parallel=tp2"]).parallel.tp == 2
