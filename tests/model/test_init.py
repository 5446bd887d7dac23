"""Initialisation schemes at model=s: every parameter starts at the std its scheme names."""
import math

import pytest
import torch

from model import build_model
from model.init import initialise
from trainer.config import ConfigError, load_config

D, L = 256, 16  # model=s: d_model, sublayers

# Parameter-name suffix -> role; the scheme maps roles to stds. Order matters: first match wins.
ROLES = (
    ("embed.weight", "embedding"),
    ("lm_head.weight", "head"),
    ("attn.o_proj.weight", "output"),
    ("down_proj.weight", "output"),
    ("mlp.w_down", "output"),
    (".weight", "hidden"),  # every other matrix: q/k/v/b/f/g projections, MLA projections, routers, w_gate, w_up
    ("mlp.w_gate", "hidden"),
    ("mlp.w_up", "hidden"),
)
SCHEME_STDS = {
    "scaled": {"embedding": 1.0, "head": D ** -0.5, "output": 0.02 / math.sqrt(L), "hidden": 0.02},
    "flat": {"embedding": 0.02, "head": 0.02, "output": 0.02, "hidden": 0.02},
}


def role_of(name: str, param: torch.Tensor) -> str | None:
    if param.dim() < 2 or "conv1d" in name:  # norms, biases, queries, A_log, dt_bias; convs keep torch's init
        return None
    return next(role for suffix, role in ROLES if name.endswith(suffix))


@pytest.mark.parametrize("scheme", ["scaled", "flat"])
@pytest.mark.parametrize("variant", ["baseline", "block"])
def test_each_matrix_starts_at_its_schemes_std(scheme, variant):
    torch.manual_seed(0)
    model = build_model(load_config(["model=s", f"variant={variant}", f"model.init={scheme}"]))
    seen = set()
    for name, param in model.named_parameters():
        role = role_of(name, param)
        if role is None:
            continue
        seen.add(role)
        expected = SCHEME_STDS[scheme][role]
        # The sample std of n normal draws is off by ~1/sqrt(2n) relative; 6 of those is far from a false alarm.
        bound = 6 / math.sqrt(2 * param.numel())
        assert abs(param.std().item() / expected - 1) < bound, (name, param.std().item(), expected)
        assert abs(param.mean().item()) < 6 * expected / math.sqrt(param.numel()), name
    assert seen == {"embedding", "head", "output", "hidden"}


def test_norms_queries_and_biases_start_neutral():
    torch.manual_seed(0)
    model = build_model(load_config(["model=s", "variant=block"]))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        if name.endswith(".query") or name.endswith("g_proj.1.bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
    for name, buffer in model.named_buffers():
        if name.endswith("expert_bias"):
            assert torch.equal(buffer, torch.zeros_like(buffer)), name


def test_initialise_is_the_only_source_of_initial_values():
    """Re-running initialise with the same seed on a model whose weights were overwritten gives the
    same weights as on a fresh copy: nothing depends on values set in a constructor."""
    cfg = load_config(["model=xs", "variant=full"])
    fresh, scrambled = build_model(cfg), build_model(cfg)
    with torch.no_grad():
        for param in scrambled.parameters():
            param.fill_(7.0)
    for model in (fresh, scrambled):
        initialise(model, cfg.model.init_stds, seed=3)
    for (name, a), b in zip(fresh.state_dict().items(), scrambled.state_dict().values()):
        assert torch.equal(a, b), name


def test_unknown_scheme_is_one_line():
    with pytest.raises(ConfigError, match=r"model.init='xavier' is not valid; allowed: scaled \| flat"):
        load_config(["model=xs", "model.init=xavier"])
