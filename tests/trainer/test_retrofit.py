"""AR-Retrofit (trainer/retrofit.py): init_from a trained baseline, train only the depth reads or the norms,
unfreeze after N steps, resume exactly, and refuse incompatible sources in one line.

Why the retrofitted model starts at the baseline's loss, and how close. With zero pseudo-queries every read
is the uniform average of its n sources, and the sources sum to the baseline's running sum S, so the read is
S / n. The sublayer's RMSNorm computes x / sqrt(mean(x^2) + eps); for x = S / n that is
S / sqrt(mean(S^2) + n^2 eps) instead of the baseline's S / sqrt(mean(S^2) + eps): the input of every
sublayer (and of the head, through the final norm) is scaled by sqrt((ms + eps) / (ms + n^2 eps)), a relative
change of about (n^2 - 1) eps / (2 ms), with ms = mean(S^2) per token. At model=xs (8 sublayers, the final
read sees n <= 9 sources under Full) with norm_eps 1e-5 and ms >= ~1 (unit-std embedding), that is <= 4e-4
per read; these perturbations compound through 8 sublayers into a loss difference measured here at
5e-6 (Block, S=2) and 1.2e-5 (Full); tolerance 1e-4. With norm_eps = 1e-12 the eps term vanishes and what
remains is float32 rounding (a division by n, another summation order): measured 0.0 for both, tolerance
1e-6. At model=s (17 reads, eps 1e-5) the same argument bounds the per-read scale change by ~1.4e-3.
"""
import json
import subprocess
import sys

import pytest
import torch

from conftest import fast_train_overrides
from parallel.dims import init_distributed
from trainer.run_dir.checkpoint import CheckpointError
from trainer.config import ConfigError, load_config
from trainer.retrofit import is_depth_read
from trainer.trained import load_trained
from trainer.trainer import Trainer


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


def train(overrides):
    return Trainer(load_config(overrides), init_distributed()).fit()


def step0_val_loss(overrides) -> float:
    trainer = Trainer(load_config(overrides), init_distributed())
    try:
        return trainer.validation_loss()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory, tiny_dataset):
    run = tmp_path_factory.mktemp("retrofit") / "baseline"
    train(fast_train_overrides(run, tiny_dataset, steps=6, variant="baseline", **{"optim.lr": 1e-2}))
    return run


def retrofit(run_dir, dataset, source, steps=6, **extra):
    return fast_train_overrides(run_dir, dataset, steps=steps, init_from=str(source), **extra)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [["variant=block", "variant.block_size=2"], ["variant=full"]])
def test_retrofit_starts_at_the_baselines_validation_loss(tmp_path, tiny_dataset, baseline_run, variant):
    baseline_val = [r["val_loss"] for r in metrics(baseline_run) if r["step"] == 6 and "val_loss" in r][0]
    retrofitted = step0_val_loss(retrofit(tmp_path / "eps", tiny_dataset, baseline_run) + variant)
    assert retrofitted == pytest.approx(baseline_val, abs=1e-4)
    # With a negligible norm eps the two are the same function up to float32 rounding: the baseline at
    # that eps (init_from into the baseline) against the retrofit at that eps.
    tiny_eps = ["++model.norm_eps=1e-12"]
    base_tiny = step0_val_loss(retrofit(tmp_path / "b", tiny_dataset, baseline_run, variant="baseline") + tiny_eps)
    retro_tiny = step0_val_loss(retrofit(tmp_path / "r", tiny_dataset, baseline_run) + variant + tiny_eps)
    assert retro_tiny == pytest.approx(base_tiny, abs=1e-6)
    print(f"{variant[0]}: |delta| at eps 1e-5 {abs(retrofitted - baseline_val):.2e}, "
          f"at eps 1e-12 {abs(retro_tiny - base_tiny):.2e}")


@pytest.mark.slow
def test_trainable_residual_leaves_every_frozen_parameter_bitwise_unchanged(tmp_path, tiny_dataset, baseline_run, capfd):
    run = tmp_path / "retro"
    train(retrofit(run, tiny_dataset, baseline_run, steps=4, variant="block", **{
        "variant.block_size": 2, "train.trainable": "residual", "optim.lr": 1e-2, "optim.weight_decay": 0.5}))
    printed = capfd.readouterr().err
    assert "trainable parameters: 1,728 of" in printed and "train.trainable=residual" in printed
    source = load_trained(baseline_run).model.state_dict()
    after = load_trained(run).model.state_dict()
    for name, tensor in source.items():  # parameters and buffers (the MoE expert bias) alike
        assert torch.equal(after[name], tensor), name
    queries = [name for name in after if is_depth_read(name) and name.endswith(".query")]
    assert len(queries) == 9
    # They start at zero; every read with two or more sources trained (the first sees only the embedding:
    # a softmax over one source has no gradient).
    assert [name for name in queries if after[name].abs().max() == 0] == ["layers.0.attn_res.query"]


def test_trainable_norms_trains_only_the_rmsnorm_gains(tmp_path, tiny_dataset, baseline_run):
    run = tmp_path / "norms"
    train(retrofit(run, tiny_dataset, baseline_run, steps=3, variant="baseline",
                   **{"train.trainable": "norms", "optim.lr": 1e-2}))
    source, after = load_trained(baseline_run).model.state_dict(), load_trained(run).model.state_dict()
    changed = sorted(name for name in source if not torch.equal(source[name], after[name]))
    assert changed and all(name.endswith("norm.weight") for name in changed), changed
    assert "layers.0.attn_norm.weight" in changed and "norm.weight" in changed


@pytest.mark.slow
def test_unfreeze_after_and_resume_before_at_and_after_it_give_the_uninterrupted_losses(tmp_path, tiny_dataset, baseline_run):
    settings = {"variant": "block", "variant.block_size": 2, "train.trainable": "residual", "train.unfreeze_after": 3}
    straight = tmp_path / "straight"
    train(retrofit(straight, tiny_dataset, baseline_run, steps=8, **settings))
    resumed = tmp_path / "resumed"
    train(retrofit(resumed, tiny_dataset, baseline_run, steps=8, **settings, **{"train.stop_after": 3}))  # at N
    train(retrofit(resumed, tiny_dataset, baseline_run, steps=8, **settings, **{"train.stop_after": 2}))  # after N
    train(retrofit(resumed, tiny_dataset, baseline_run, steps=8, **settings))
    assert sorted(losses(resumed)) == list(range(1, 9))
    assert losses(straight) == losses(resumed)  # bitwise
    source, after = load_trained(baseline_run).model.state_dict(), load_trained(resumed).model.state_dict()
    assert not torch.equal(source["layers.1.attn_norm.weight"], after["layers.1.attn_norm.weight"])  # unfrozen


@pytest.mark.slow
def test_init_from_is_ignored_on_resume(tmp_path, tiny_dataset, baseline_run, capfd):
    run = tmp_path / "run"
    train(retrofit(run, tiny_dataset, baseline_run, steps=4, variant="block", **{"train.stop_after": 3}))
    train(retrofit(run, tiny_dataset, tmp_path / "gone", steps=4, variant="block"))  # a missing init_from is unused
    printed = capfd.readouterr().err
    assert printed.count("init_from: weights of") == 1 and printed.count("resumed from") == 1
    assert max(losses(run)) == 4


@pytest.mark.slow
def test_an_incompatible_source_is_one_line_naming_the_parameter(tmp_path, tiny_dataset, baseline_run):
    wider = tmp_path / "wider"
    train(fast_train_overrides(wider, tiny_dataset, steps=1, variant="baseline", **{"model.dense_inter": 128}))
    with pytest.raises(CheckpointError) as error:
        Trainer(load_config(retrofit(tmp_path / "a", tiny_dataset, wider, variant="block")), init_distributed())
    assert "layers.0.mlp.gate_proj.weight has shape (128, 96) in the source and (256, 96) here" in str(error.value)
    assert "\n" not in str(error.value)
    block = tmp_path / "block"
    train(fast_train_overrides(block, tiny_dataset, steps=1, variant="block"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn_res\.query of the source does not exist in this model"):
        Trainer(load_config(retrofit(tmp_path / "b", tiny_dataset, block, variant="baseline")), init_distributed())


@pytest.mark.slow
def test_a_missing_init_from_is_one_error_line(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "trainer.main",
                             *retrofit(run, tiny_dataset, tmp_path / "nowhere", variant="block")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: init_from={tmp_path / 'nowhere'} does not exist; give a run directory, one of its checkpoints or "
        "a inference.export format=hf directory"]
    assert not (run / "checkpoints").exists()


def test_unfreeze_after_needs_a_frozen_start():
    with pytest.raises(ConfigError, match=r"train.unfreeze_after=5 needs train.trainable=residual or norms"):
        load_config(["train.unfreeze_after=5"])
    with pytest.raises(ConfigError, match=r"train.trainable='some' is not valid; allowed: all \| residual \| norms"):
        load_config(["train.trainable=some"])


def test_layouts_retrofit_cannot_serve_are_refused_in_one_line():
    from trainer.retrofit import check_layout

    frozen = load_config(["train.trainable=residual"]).train
    with pytest.raises(ConfigError, match=r"^train.trainable=residual needs a single process"):
        check_layout(frozen, None, world_size=2, tp=1, fsdp=1)
    with pytest.raises(ConfigError, match=r"^init_from=runs/x loads whole tensors; it is not supported with parallel.tp"):
        check_layout(load_config().train, "runs/x", world_size=2, tp=2, fsdp=1)
    check_layout(load_config().train, "runs/x", world_size=2, tp=1, fsdp=1)  # dp: whole tensors, fine
