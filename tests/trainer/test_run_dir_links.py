"""A directory of run.dir replaced by a symlink after the start-up check (issue 55, item 1): checkpoints/,
.tmp-step_N, hang/, profile/ and run.dir itself (the logs, config.yaml, finished.json). Each write, rename
and removal reaches its directory without following a link, so the link's target (here another run's
checkpoints and files) is left byte for byte as it was, and the refusal is one line naming the link."""
import os
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from trainer.config import load_config
from trainer.hang import HangWatchdog
from trainer.metrics import MetricsLogger, StepProfiler, keep_rows_up_to
from trainer.run_dir.async_checkpoint import CheckpointSaver
from trainer.run_dir.checkpoint import (
    CheckpointError,
    begin_save,
    dcp_state,
    hash_share,
    latest_checkpoint,
    publish,
    remove_partial_saves,
    verify_checkpoint,
)
from trainer.run_dir.finished import record_finished
from trainer.files.safe_io import LinkedPathError, write_file

PLANTED = ("is a symlink (to {target}), planted after the start-up check: nothing is written or removed through "
           "a link, which could reach outside the directory being written; remove the link and run again")


def planted(path, target) -> str:
    return f"{path} " + PLANTED.format(target=target)


def snapshot(root):
    """Every entry under root, links not followed: a file's bytes, a link's target, a directory's name."""
    return {p.relative_to(root).as_posix(): ("link", os.readlink(p)) if p.is_symlink()
            else ("dir",) if p.is_dir() else ("file", p.read_bytes()) for p in sorted(root.rglob("*"))}


@pytest.fixture
def victim(tmp_path):
    """Another run's checkpoints/: three checkpoints and a partial save, each with files of its own."""
    checkpoints = tmp_path / "other_run" / "checkpoints"
    for step in (1, 2, 3):
        step_dir = checkpoints / f"step_{step:08d}"
        (step_dir / "extra").mkdir(parents=True)
        (step_dir / "meta.json").write_text(f'{{"step": {step}}}\n')
        (step_dir / "__0_0.distcp").write_bytes(bytes(range(step, step + 64)))
        (step_dir / "extra" / "rank_0.json").write_text("{}")
    (checkpoints / ".tmp-step_00000004").mkdir()
    (checkpoints / ".tmp-step_00000004" / "__0_0.distcp").write_bytes(b"partial")
    return checkpoints


def one_line(refused) -> str:
    message = str(refused.value)
    assert "\n" not in message
    return message


def tiny_model():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, [optimizer]


@pytest.fixture(autouse=True)
def single_process_dcp():
    with warnings.catch_warnings():  # DCP warns on every call without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@pytest.mark.parametrize("mode", ["off", "async"])
def test_a_checkpoints_dir_linked_mid_run_gets_no_save_and_loses_no_checkpoint(tmp_path, victim, mode):
    """Before: the save landed in the other run's checkpoints/ and keep_last pruned its step_* directories."""
    run = tmp_path / "run"
    model, optimizers = tiny_model()
    saver = CheckpointSaver(mode, torch.device("cpu"))
    try:
        saver.save(run, 5, model, optimizers, None, {"step": 5}, {}, keep_last=1)
        saver.wait()
        moved = tmp_path / "moved"
        (run / "checkpoints").rename(moved)  # where whoever planted the link put the run's own
        (run / "checkpoints").symlink_to(victim)
        before, ours = snapshot(victim), snapshot(moved)
        with pytest.raises(CheckpointError) as refused:
            saver.save(run, 6, model, optimizers, None, {"step": 6}, {}, keep_last=1)
            saver.wait()
    finally:
        saver.close()
    assert one_line(refused) == ("the checkpoint of step 6 was not saved and no checkpoint was removed: "
                                 + planted(run / "checkpoints", victim))
    assert snapshot(victim) == before
    assert snapshot(moved) == ours
    verify_checkpoint(moved / "step_00000005")


def test_a_tmp_dir_swapped_for_a_link_mid_save_receives_nothing_and_is_not_published(tmp_path, victim):
    """DCP writes through the directory begin_save holds open, so a link planted at .tmp-step_N after it was
    made (here between begin_save and the write) is never written through, and publish refuses the swap."""
    run = tmp_path / "run"
    model, optimizers = tiny_model()
    saver = CheckpointSaver("off", torch.device("cpu"))
    saver.save(run, 1, model, optimizers, None, {"step": 1}, {}, keep_last=3)
    pending = begin_save(run, 2, model, {"step": 2})
    try:
        tmp = run / "checkpoints" / ".tmp-step_00000002"
        tmp.rename(tmp_path / "moved_tmp")
        tmp.symlink_to(victim)
        before = snapshot(victim)
        dcp.save(dcp_state(model, optimizers, None, None), checkpoint_id=pending.target)
        with pytest.raises(CheckpointError) as refused:
            publish(pending, {}, 1, hash_share(pending.target, 0, 1))
    finally:
        pending.close()
    assert one_line(refused) == (f"the checkpoint of step 2 was not saved and no checkpoint was removed: {tmp} was "
                                 "replaced or moved while it was being written; nothing was published from it: "
                                 "find out what changed the directory, then run again")
    assert snapshot(victim) == before
    assert sorted(p.name for p in (tmp_path / "moved_tmp").iterdir()) == [".metadata", "__0_0.distcp", "extra"]
    assert latest_checkpoint(run) == run / "checkpoints" / "step_00000001"
    verify_checkpoint(run / "checkpoints" / "step_00000001")


def test_partial_saves_are_not_removed_through_a_linked_checkpoints_dir(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(victim)
    before = snapshot(victim)
    with pytest.raises(LinkedPathError) as refused:
        remove_partial_saves(run)
    assert one_line(refused) == planted(run / "checkpoints", victim)
    assert snapshot(victim) == before


def test_hang_stacks_are_not_written_through_a_linked_hang_dir(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / "hang").symlink_to(victim)
    before = snapshot(victim)
    lines = []
    watchdog = HangWatchdog(run / "hang", 0, 0.2, lines.append)
    try:
        watchdog.start(7)
        deadline = time.monotonic() + 30
        while not lines and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watchdog.close()
    [line] = lines
    assert line.startswith("hang: rank 0, step 7 has run ")
    assert line.endswith("(train.hang_after_s); its stacks were not written: " + planted(run / "hang", victim))
    assert snapshot(victim) == before


def test_a_profile_trace_is_not_written_through_a_linked_profile_dir(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    profiler = StepProfiler([1, 1], run / "profile", 0, torch.device("cpu"))
    profiler.before_step(1)
    torch.ones(8, 8) @ torch.ones(8, 8)
    (run / "profile").symlink_to(victim)  # made after the start: profile/ did not exist until the trace
    before = snapshot(victim)
    with pytest.raises(LinkedPathError) as refused:
        profiler.after_step(1)
    assert one_line(refused) == planted(run / "profile", victim)
    assert snapshot(victim) == before
    assert profiler.close() is None  # the trainer's last close() does not stop the profiler a second time


def test_the_logs_config_and_finished_json_are_not_written_through_a_linked_run_dir(tmp_path, victim):
    """train.log, metrics.jsonl and diagnostics.jsonl refused their own name as a link already; a run.dir
    itself replaced by a link (the logs' parent) is refused now too, and so are config.yaml and finished.json."""
    run = tmp_path / "run"
    run.mkdir()
    logger = MetricsLogger(load_config(["train.steps=4", "logging.wandb.mode=disabled"]), run, True, 0)
    logger.print("first line")
    logger.log({"step": 1, "loss": 1.0})
    run.rename(tmp_path / "moved")
    run.symlink_to(victim)
    (victim / "metrics.jsonl").write_text('{"step": 3}\n')  # a row after step 0: keep_rows_up_to would rewrite it
    before = snapshot(victim)
    for write in (lambda: logger.print("second line"), lambda: logger.log({"step": 2, "loss": 0.5}),
                  lambda: logger.log_diagnostics({"step": 2, "output_rms": {}, "grad_rms": {}}),
                  lambda: keep_rows_up_to(run / "metrics.jsonl", 0),
                  lambda: write_file(run / "config.yaml", "seed: 0\n", root=run),
                  lambda: record_finished(run, 4)):
        with pytest.raises(LinkedPathError) as refused:
            write()
        assert one_line(refused) == planted(run, victim)
    logger.close()
    assert snapshot(victim) == before
    assert [line.split(" ", 2)[2] for line in (tmp_path / "moved" / "train.log").read_text().splitlines()] == [
        "first line"]
