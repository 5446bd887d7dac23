"""The comparison report on real tiny runs (baseline and Block), plus copies of them edited into a
block-size sweep and a three-size scaling grid; the power-law fit on a known law."""
import json
import shutil

import pytest
from omegaconf import OmegaConf

from conftest import fast_train_overrides
from parallel.dims import init_distributed
from scripts.report import build_report
from scripts.report.stats import PowerLaw, compute_multiplier, fit_power_law, noise_verdict
from trainer.config import load_config
from trainer.trainer import Trainer


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, tiny_dataset):
    """A finished baseline and Block (S=2) run of 6 steps with diagnostics at steps 3 and 6."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    for name, variant in (("baseline", ["variant=baseline"]), ("block", ["variant=block", "variant.block_size=2"])):
        dirs[name] = root / f"xs-{name}-s0"
        Trainer(load_config([*fast_train_overrides(dirs[name], tiny_dataset, steps=6), *variant]),
                init_distributed()).fit()
    return dirs


def final_val_loss(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if "val_loss" in r][-1]


def edited_copy(source, target, config: dict, loss_scale: float = 1.0):
    """A copy of a run directory with config keys replaced and every loss scaled."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("checkpoints"))
    cfg = OmegaConf.load(target / "config.yaml")
    for key, value in config.items():
        OmegaConf.update(cfg, key, value)
    OmegaConf.save(cfg, target / "config.yaml")
    records = [json.loads(line) for line in (target / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r.update({k: r[k] * loss_scale for k in ("loss", "val_loss") if k in r})
    (target / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return target


def test_report_holds_every_figure_and_the_runs_numbers(tmp_path, tiny_runs):
    report = build_report(list(tiny_runs.values()), tmp_path / "report", "tiny")
    out = report.parent
    for name in ["loss_vs_tokens.png", "loss_vs_compute.png", "magnitudes_xs.png", "depth_xs_block-S-2.png",
                 "layer_importance.png"]:
        assert (out / name).stat().st_size > 1000, name
    text = report.read_text()
    for run_dir in tiny_runs.values():
        assert f"{final_val_loss(run_dir):.4f}" in text
    diff = final_val_loss(tiny_runs["block"]) - final_val_loss(tiny_runs["baseline"])
    assert f"{diff:+.4f}" in text
    assert "single seed, no noise estimate" in text
    assert "| xs | block S=2 |" in text and "pre-attention" in text
    for image in [line.split("(")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]:
        assert (out / image).is_file(), image


def test_report_draws_the_block_size_sweep_and_the_scaling_fit(tmp_path, tiny_runs):
    runs = [*tiny_runs.values(), edited_copy(tiny_runs["block"], tmp_path / "xs-block4-s0",
                                             {"model.residual.block_size": 4}, loss_scale=1.01)]
    for i, width in enumerate((128, 192)):  # two more sizes: three in all for each variant
        for name, source in tiny_runs.items():
            runs.append(edited_copy(source, tmp_path / f"w{width}-{name}-s0", {"model.d_model": width},
                                    loss_scale=0.9 - 0.1 * i))
    report = build_report(runs, tmp_path / "report", "sweep")
    text = report.read_text()
    assert (report.parent / "block_size_sweep_xs.png").is_file() and "## Block-size sweep (xs)" in text
    assert (report.parent / "scaling.png").is_file() and "| baseline |" in text.split("## Scaling")[1]
    assert "the baseline's fit needs" in text


def test_power_law_fit_recovers_a_known_law():
    law = PowerLaw(A=40.0, alpha=0.07)
    compute = [1e15, 3e15, 1e16, 4e16, 1e17]
    fit = fit_power_law(compute, [law.loss(c) for c in compute])
    assert fit.A == pytest.approx(40.0, rel=1e-9) and fit.alpha == pytest.approx(0.07, rel=1e-9)
    # A variant that reaches at C the baseline's loss at 1.25 C has a 1.25x compute multiplier.
    assert compute_multiplier(law, law.loss(1.25e17), 1e17) == pytest.approx(1.25, rel=1e-9)


def test_noise_verdict_uses_pooled_seed_spread():
    assert noise_verdict([2.0], [2.1]) == "single seed, no noise estimate"
    assert noise_verdict([2.00, 2.02, 2.04], [2.01, 2.03, 2.05]).startswith("inside seed noise")
    assert noise_verdict([1.90, 1.91, 1.92], [2.01, 2.02, 2.03]).startswith("outside seed noise")
