"""DCP checkpoints: round trip, retention, atomicity, validation, compatibility, checksums with resume=auto
falling back past corrupt checkpoints, and loading that never runs code planted in a checkpoint."""
import dataclasses
import hashlib
import io
import json
import os
import pickle
import random
import shutil

import numpy as np

import pytest
import torch
import torch.nn.functional as F

from model import build_model
from model.config import ModelConfig, ResidualConfig
from conftest import fast_train_overrides, launch_job
from parallel.dims import init_distributed
from trainer.run_dir.checkpoint import (
    CheckpointError,
    CheckpointFormatError,
    check_compatible,
    latest_checkpoint,
    load_checkpoint,
    meta_digest,
    model_fingerprint,
    newest_verified_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    seal_meta,
)
from trainer.config import load_config
from trainer.optim import build_optimizer, build_scheduler
from trainer.rng_state import rng_state, set_rng_state
from trainer.trainer import Trainer


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
    rng = rng_state()
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
    assert extra == {"sample": 7, "rng": rng}
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
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    model, opt, scheduler = make_run(cfg, seed=1)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, model, opt.optimizers, scheduler, rank=0)
    assert str(error.value) == (f"checkpoint {path} is corrupt: {shard.name} is {size // 2} bytes, meta.json records "
                                f"{size} (truncated or overwritten)")


@pytest.mark.parametrize("part", [".metadata", "meta.json", "extra/rank_0.json"])
def test_missing_part_is_a_checkpoint_error_naming_it(tmp_path, cfg, trained, part):
    path = save(tmp_path, 1, trained, cfg)
    (path / part).unlink()
    model, opt, scheduler = make_run(cfg, seed=1)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is incomplete: missing {part}$"):
        load_checkpoint(path, model, opt.optimizers, scheduler, rank=0)


def test_fingerprint_mismatch_names_only_the_differing_keys():
    block = model_fingerprint(ModelConfig(d_model=256))
    full = model_fingerprint(ModelConfig(d_model=256, residual=ResidualConfig(kind="full")))
    check_compatible({"model_fingerprint": block}, block, "runs/a/checkpoints/step_00000100")
    with pytest.raises(CheckpointError) as error:
        check_compatible({"model_fingerprint": block}, full, "runs/a/checkpoints/step_00000100")
    assert str(error.value) == ("checkpoint runs/a/checkpoints/step_00000100 was written by variant.kind=block; "
                                "this run has variant.kind=full")
    with pytest.raises(CheckpointError, match="^checkpoint was written by model.d_model=256; this run has model.d_model=128$"):
        check_compatible({"model_fingerprint": block}, model_fingerprint(ModelConfig(d_model=128)))


def test_fingerprints_of_two_mla_lists_differ_by_that_key():
    """A list is one item of the fingerprint (model.mla_layers=[3,7]): split at its spaces, [3, 7] and [3, 8]
    would both read as `[3,` and pass as the same model."""
    ours = model_fingerprint(ModelConfig(mla_layers=[3, 7]))
    with pytest.raises(CheckpointError, match=r"^checkpoint was written by model.mla_layers=\[3,8\]; this run has "
                                              r"model.mla_layers=\[3,7\]$"):
        check_compatible({"model_fingerprint": model_fingerprint(ModelConfig(mla_layers=[3, 8]))}, ours)
    check_compatible({"model_fingerprint": model_fingerprint(ModelConfig())}, model_fingerprint(ModelConfig()))


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


# -- format: JSON extra files, checksums --------------------------------------------------------

def test_rng_state_survives_json_exactly():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    np.random.standard_normal(), random.gauss(0, 1)  # both now hold a cached second Gaussian
    state = json.loads(json.dumps(rng_state()))
    expected = (torch.rand(4), np.random.standard_normal(3), [random.gauss(0, 1) for _ in range(3)])
    torch.manual_seed(4), np.random.seed(4), random.seed(4)
    set_rng_state(state)
    again = (torch.rand(4), np.random.standard_normal(3), [random.gauss(0, 1) for _ in range(3)])
    assert torch.equal(again[0], expected[0]) and np.array_equal(again[1], expected[1]) and again[2] == expected[2]


def test_meta_json_records_the_size_and_sha256_of_every_other_file(tmp_path, cfg, trained):
    path = save(tmp_path, 1, trained, cfg)
    meta = json.loads((path / "meta.json").read_text())
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert files == sorted([*meta["files"], "meta.json"])
    assert files == [".metadata", "__0_0.distcp", "extra/rank_0.json", "meta.json"]
    for name, record in meta["files"].items():
        data = (path / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert json.loads((path / "extra/rank_0.json").read_text()) == {"sample": 1}
    assert meta["format"] == 3
    assert meta["meta_sha256"] == meta_digest(meta)  # damage to meta.json itself is corruption too


# -- nothing from a checkpoint runs code --------------------------------------------------------

class RunsShellCommand:
    """Unpickling this runs `touch marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def rewrite_checksums(path):
    """What someone planting a file would also do: make meta.json's checksums match the files again."""
    meta = json.loads((path / "meta.json").read_text())
    names = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != "meta.json")
    meta["files"] = {name: {"bytes": (path / name).stat().st_size,
                            "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest()} for name in names}
    (path / "meta.json").write_text(json.dumps(seal_meta(meta)))


def load_fresh(path, cfg):
    model, opt, scheduler = make_run(cfg, seed=1)
    return load_checkpoint(path, model, opt.optimizers, scheduler, rank=0)


def test_planted_dcp_metadata_pickle_is_refused_without_running(tmp_path, cfg, trained):
    path = save(tmp_path / "run", 1, trained, cfg)
    marker = tmp_path / "MARKER"
    (path / ".metadata").write_bytes(pickle.dumps(RunsShellCommand(marker)))
    rewrite_checksums(path)
    with pytest.raises(CheckpointError) as error:
        load_fresh(path, cfg)
    assert not marker.exists()
    assert str(error.value) == (f"checkpoint {path}: .metadata could not be read (UnsafeCheckpointData: "
                                "posix.system is not allowed in DCP metadata (refusing to unpickle it))")


def test_planted_pickle_in_a_non_tensor_entry_is_refused_without_running(tmp_path, cfg, trained):
    path = save(tmp_path / "run", 1, trained, cfg)
    marker = tmp_path / "MARKER"
    # Point the scheduler's last_epoch entry at a torch.save'd payload appended to the shard.
    metadata = pickle.loads((path / ".metadata").read_bytes())  # our own, just written
    index = next(i for i in metadata.storage_data if i.fqn == "scheduler.last_epoch")
    info = metadata.storage_data[index]
    payload = io.BytesIO()
    torch.save(RunsShellCommand(marker), payload)
    shard = path / info.relative_path
    offset = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_checksums(path)
    with pytest.raises(CheckpointError) as error:
        load_fresh(path, cfg)
    assert not marker.exists()
    assert str(error.value).startswith(f"checkpoint {path} could not be read (rank 0: UnsafeCheckpointData: entry "
                                       "scheduler.last_epoch is not a plain value (Weights only load failed")
    assert "\n" not in str(error.value)


def make_old_format(path, marker):
    """The format before checksums: no `format`/`files` in meta.json, extra/rank_0.pt pickled."""
    meta = json.loads((path / "meta.json").read_text())
    meta.pop("format", None), meta.pop("files", None)
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "extra/rank_0.json").unlink(missing_ok=True)
    torch.save(RunsShellCommand(marker), path / "extra/rank_0.pt")


def test_old_format_checkpoint_is_refused_in_one_line_without_unpickling(tmp_path, cfg, trained):
    older, newer = save(tmp_path / "run", 1, trained, cfg), save(tmp_path / "run", 2, trained, cfg)
    marker = tmp_path / "MARKER"
    make_old_format(newer, marker)
    message = (f"checkpoint {newer} is not in checkpoint format 3: the earlier format (pickled extra/rank_N.pt, no "
               "checksums) is no longer loaded, since reading it means unpickling; start a new run.dir")
    with pytest.raises(CheckpointFormatError) as error:
        load_fresh(newer, cfg)
    assert str(error.value) == message
    # resume=auto does not skip past it to the older one: that would quietly restart the run from there.
    with pytest.raises(CheckpointFormatError, match="not in checkpoint format 3"):
        newest_verified_checkpoint(tmp_path / "run")
    assert not marker.exists() and older.is_dir()


# -- corrupt checkpoints: resume=auto falls back, resume=PATH refuses -----------------------------

def train(overrides):
    trainer = Trainer(load_config(overrides), init_distributed())
    trainer.fit()
    return trainer


def losses_by_step(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, tiny_dataset):
    """A finished 4-step run with checkpoints at steps 2 and 4 (and one at 3 if the trainer keeps a wsd
    run's pre-decay checkpoint)."""
    run = tmp_path_factory.mktemp("four_steps") / "run"
    train(fast_train_overrides(run, tiny_dataset, steps=4, **{"train.ckpt_every": 2, "train.keep_last": 3}))
    return run


def truncate(file, size):
    file.write_bytes(file.read_bytes()[:size])


def flip_middle_bytes(file):
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    file.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated shard": (lambda ckpt: truncate(ckpt / "__0_0.distcp", 0),
                        "is corrupt: __0_0.distcp is 0 bytes, meta.json records"),
    "bytes overwritten inside a shard": (lambda ckpt: flip_middle_bytes(ckpt / "__0_0.distcp"),
                                         "is corrupt: __0_0.distcp does not match its sha256 in meta.json"),
    "truncated extra file": (lambda ckpt: truncate(ckpt / "extra/rank_0.json", 100),
                             "is corrupt: extra/rank_0.json is 100 bytes, meta.json records"),
    "truncated meta.json": (lambda ckpt: truncate(ckpt / "meta.json", 100),
                            "has an unreadable meta.json: "),
    "missing shard": (lambda ckpt: (ckpt / "__0_0.distcp").unlink(), "is incomplete: missing __0_0.distcp"),
}


@pytest.mark.slow
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_resume_auto_skips_a_corrupt_newest_checkpoint_and_resumes_from_the_previous(
        tmp_path, tiny_dataset, four_steps, capfd, corruption):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    corrupt, reason = CORRUPTIONS[corruption]
    newest = run / "checkpoints" / "step_00000004"
    corrupt(newest)
    capfd.readouterr()

    previous = sorted((run / "checkpoints").glob("step_*"))[-2]
    trainer = train(fast_train_overrides(run, tiny_dataset, steps=4, **{"train.ckpt_every": 2, "train.keep_last": 3}))
    assert trainer.resumed.path == previous
    [skip_line] = [line for line in capfd.readouterr().err.splitlines() if "skipping" in line]
    assert skip_line.startswith(f"resume=auto: skipping checkpoint {newest} {reason}")
    # metrics.jsonl now holds the steps after `previous` as this launch redid them: bitwise the same.
    assert losses_by_step(run) == losses_by_step(four_steps)
    assert newest_verified_checkpoint(run) == (newest, [])  # re-saved whole


def test_resume_path_to_a_corrupt_checkpoint_is_an_error_not_a_fallback(tmp_path, tiny_dataset, four_steps):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    newest = run / "checkpoints" / "step_00000004"
    flip_middle_bytes(newest / "__0_0.distcp")
    with pytest.raises(CheckpointError) as error:
        train(fast_train_overrides(run, tiny_dataset, steps=6, resume=str(newest)))
    assert str(error.value) == (f"checkpoint {newest} is corrupt: __0_0.distcp does not match its sha256 in meta.json "
                                "(its bytes changed after it was written)")


def test_resume_auto_with_no_checkpoint_that_verifies_refuses_to_start_over(tmp_path, tiny_dataset, four_steps, capfd):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    checkpoints = sorted((run / "checkpoints").glob("step_*"), reverse=True)
    for checkpoint in checkpoints:
        flip_middle_bytes(checkpoint / "__0_0.distcp")
    with pytest.raises(CheckpointError) as error:
        train(fast_train_overrides(run, tiny_dataset, steps=4))
    assert str(error.value) == (f"resume=auto: none of the {len(checkpoints)} checkpoints in {run / 'checkpoints'} "
                                "verifies (see above); move them away to start the run over")
    skipped = [line for line in capfd.readouterr().err.splitlines() if line.startswith("resume=auto: skipping")]
    assert [line.split()[3] for line in skipped] == [str(c) for c in checkpoints]


def test_a_corrupt_newer_checkpoint_does_not_get_the_new_one_pruned(tmp_path, cfg, trained):
    checkpoints = tmp_path / "checkpoints"
    good, bad = save(tmp_path, 2, trained, cfg), save(tmp_path, 4, trained, cfg)
    flip_middle_bytes(bad / "__0_0.distcp")
    # The run resumed from step 2 and saves step 3 with keep_last=1: step 3 is kept (and 2 goes, now that a
    # newer good one exists), not only the corrupt 4, which the old name-order pruning kept alone.
    saved = save(tmp_path, 3, trained, cfg, keep_last=1)
    assert sorted(os.listdir(checkpoints)) == ["step_00000003", "step_00000004"]
    assert newest_verified_checkpoint(tmp_path) == (saved, [(bad, f"checkpoint {bad} is corrupt: __0_0.distcp does "
                                                            "not match its sha256 in meta.json (its bytes changed "
                                                            "after it was written)")])


ASYNC_SAVES = {"train.ckpt_every": 2, "checkpoint.async_mode": "async"}


@launch_job(2)
def async_run(root, dataset):
    return [fast_train_overrides(root / "run", dataset, steps=4, **ASYNC_SAVES)]


def test_under_torchrun_ranks_split_the_checksums_and_fall_back_together(tmp_path, tiny_dataset, launched,
                                                                         torchrun_runs):
    """Two ranks: sorted files [.metadata, __0_0.distcp, __1_0.distcp, extra/rank_0.json, extra/rank_1.json],
    so only rank 1 hashes __0_0.distcp; both must skip the checkpoint, or rank 0 would load it alone. The saves
    are asynchronous (checkpoint.async_mode=async): each rank hashes its share once both ranks' background
    writes are done, and the resume from step 2's checkpoint continues the run bitwise. The first run is the
    session's 2-rank launch's; the resume, which follows the corruption, a launch of its own."""
    run = tmp_path / "run"
    shutil.copytree(launched(async_run) / "run", run)
    overrides = fast_train_overrides(run, tiny_dataset, steps=4, **ASYNC_SAVES)
    uninterrupted = losses_by_step(run)
    *_, previous, newest = sorted((run / "checkpoints").glob("step_*"))
    assert sorted(json.loads((newest / "meta.json").read_text())["files"]) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "extra/rank_0.json", "extra/rank_1.json"]
    flip_middle_bytes(newest / "__0_0.distcp")
    result = torchrun_runs([overrides], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resume=auto: skipping checkpoint {newest} is corrupt: __0_0.distcp does not match" in result.stderr
    assert f"resumed from {previous}" in result.stdout + result.stderr
    assert losses_by_step(run) == uninterrupted
