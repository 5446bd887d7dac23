"""DCP checkpoints in a single process: round trip, retention, atomicity, validation, compatibility."""
import dataclasses
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from model import build_model
from model.config import ModelConfig, ResidualConfig
from trainer.checkpoint import (
    CheckpointError,
    check_compatible,
    latest_checkpoint,
    load_checkpoint,
    model_fingerprint,
    resolve_checkpoint,
    save_checkpoint,
)
from trainer.config import load_config
from trainer.optim import build_optimizer, build_scheduler


@pytest.fixture(scope="module")
def cfg():
    return load_config(["model=xs", "train.steps=20", "train.warmup_steps=4"])


def make_run(cfg, seed, optim="adamw"):
    """Model, optimizer and scheduler. AdamW unless asked: Muon's bf16 steps are slow on a busy CPU."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    opt = build_optimizer(model, dataclasses.replace(cfg.optim, name=optim))
    return model, opt, build_scheduler(opt, cfg.train)


def train_step(model, opt, scheduler, cfg):
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    scheduler.step()
    opt.zero_grad(set_to_none=True)
    model.update_moe_bias()


def save(run_dir, step, run, cfg, keep_last=3):
    model, opt, scheduler = run
    return save_checkpoint(run_dir, step, model, opt.optimizers, scheduler, extra={"sample": step},
                           meta={"model_fingerprint": model_fingerprint(cfg.model)}, keep_last=keep_last)


@pytest.fixture
def trained(cfg):
    run = make_run(cfg, seed=0)
    train_step(*run, cfg)
    return run


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_round_trip_restores_model_optimizers_scheduler_and_extra(tmp_path, cfg):
    model, opt, scheduler = make_run(cfg, seed=0, optim="muon")
    train_step(model, opt, scheduler, cfg)
    rng = torch.get_rng_state()
    path = save_checkpoint(tmp_path, 1, model, opt.optimizers, scheduler, extra={"sample": 7, "rng": rng},
                           meta={"model_fingerprint": model_fingerprint(cfg.model)}, keep_last=3)
    assert path == tmp_path / "checkpoints" / "step_00000001"

    fresh_model, fresh_opt, fresh_scheduler = make_run(cfg, seed=1, optim="muon")
    extra, meta = load_checkpoint(path, fresh_model, fresh_opt.optimizers, fresh_scheduler, rank=0,
                                  fingerprint=model_fingerprint(cfg.model))
    assert same(model.state_dict(), fresh_model.state_dict())  # includes the MoE expert_bias buffers
    assert any(b.abs().sum() > 0 for n, b in fresh_model.state_dict().items() if n.endswith("expert_bias"))
    assert same(opt.state_dict(), fresh_opt.state_dict())
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    assert extra["sample"] == 7 and torch.equal(extra["rng"], rng)
    assert meta["step"] == 1 and meta["world_size"] == 1 and meta["model_fingerprint"] == model_fingerprint(cfg.model)


def test_model_only_load_and_missing_rank_extra_falls_back_to_rank_0(tmp_path, cfg, trained):
    path = save(tmp_path, 1, trained, cfg)
    fresh = build_model(cfg)
    extra, meta = load_checkpoint(path, fresh, [], None, rank=3)
    assert same(trained[0].state_dict(), fresh.state_dict())
    assert extra == {"sample": 1} and meta["world_size"] == 1


def test_keep_last_deletes_the_oldest(tmp_path, cfg, trained):
    for step in (10, 20, 30, 40):
        save(tmp_path, step, trained, cfg, keep_last=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000030", "step_00000040"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000040"


def test_half_written_checkpoints_are_ignored_then_cleaned_up(tmp_path, cfg, trained):
    first = save(tmp_path, 1, trained, cfg)
    killed = tmp_path / "checkpoints" / ".tmp-step_00000002"
    shutil.copytree(first, killed)  # complete-looking files, but never renamed into place
    no_meta = tmp_path / "checkpoints" / "step_00000003"
    shutil.copytree(first, no_meta)
    (no_meta / "meta.json").unlink()
    assert latest_checkpoint(tmp_path) == first
    assert resolve_checkpoint(tmp_path) == first

    save(tmp_path, 4, trained, cfg)
    assert not killed.exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000004"


def test_resolve_checkpoint(tmp_path, cfg, trained):
    path = save(tmp_path, 5, trained, cfg)
    assert resolve_checkpoint(path) == path
    assert resolve_checkpoint(str(tmp_path)) == path
    with pytest.raises(CheckpointError, match="neither a checkpoint directory"):
        resolve_checkpoint(tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")
    empty_run = tmp_path / "empty"
    (empty_run / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint(empty_run)


def test_truncated_shard_is_a_checkpoint_error_naming_the_path(tmp_path, cfg, trained):
    path = save(tmp_path, 1, trained, cfg)
    [shard] = path.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    model, opt, scheduler = make_run(cfg, seed=1)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} could not be read") as error:
        load_checkpoint(path, model, opt.optimizers, scheduler, rank=0)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("part", [".metadata", "meta.json", "extra/rank_0.pt"])
def test_missing_part_is_a_checkpoint_error_naming_it(tmp_path, cfg, trained, part):
    path = save(tmp_path, 1, trained, cfg)
    (path / part).unlink()
    model, opt, scheduler = make_run(cfg, seed=1)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is incomplete: missing {part}$"):
        load_checkpoint(path, model, opt.optimizers, scheduler, rank=0)


def test_fingerprint_mismatch_names_only_the_differing_keys():
    block = model_fingerprint(ModelConfig(d_model=256))
    full = model_fingerprint(ModelConfig(d_model=256, residual=ResidualConfig(variant="full")))
    check_compatible({"model_fingerprint": block}, block, "runs/a/checkpoints/step_00000100")
    with pytest.raises(CheckpointError) as error:
        check_compatible({"model_fingerprint": block}, full, "runs/a/checkpoints/step_00000100")
    assert str(error.value) == ("checkpoint runs/a/checkpoints/step_00000100 was written by variant.variant=block; "
                                "this run has variant.variant=full")
    with pytest.raises(CheckpointError, match="^checkpoint was written by model.d_model=256; this run has model.d_model=128$"):
        check_compatible({"model_fingerprint": block}, model_fingerprint(ModelConfig(d_model=128)))


def test_load_refuses_another_model_before_touching_weights(tmp_path, cfg, trained):
    path = save(tmp_path, 1, trained, cfg)
    model, opt, scheduler = make_run(cfg, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    other = model_fingerprint(ModelConfig(d_model=cfg.model.d_model * 2))
    with pytest.raises(CheckpointError, match="model.d_model="):
        load_checkpoint(path, model, opt.optimizers, scheduler, rank=0, fingerprint=other)
    assert same(before, model.state_dict())


def test_non_finite_weights_refuse_to_save_and_keep_the_previous_checkpoint(tmp_path, cfg, trained):
    first = save(tmp_path, 1, trained, cfg)
    model = trained[0]
    with torch.no_grad():
        model.layers["0"].attn_norm.weight[0] = float("nan")
    with pytest.raises(CheckpointError, match="layers.0.attn_norm.weight is not finite"):
        save(tmp_path, 2, trained, cfg)
    assert os.listdir(tmp_path / "checkpoints") == [first.name]
    assert latest_checkpoint(tmp_path) == first
    fresh = build_model(cfg)
    load_checkpoint(first, fresh, [], None, rank=0)
    assert all(torch.isfinite(p).all() for p in fresh.parameters())


def test_option_added_after_the_checkpoint_compares_as_its_default():
    ours = model_fingerprint(ModelConfig(d_model=256))
    older = " ".join(item for item in ours.split() if not item.startswith("variant.streams="))
    check_compatible({"model_fingerprint": older}, ours)
    with pytest.raises(CheckpointError, match="variant.streams=4; this run has variant.streams=2$"):
        check_compatible({"model_fingerprint": older},
                         model_fingerprint(ModelConfig(d_model=256, residual=ResidualConfig(streams=2))))
