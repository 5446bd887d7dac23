"""checkpoint.async_mode=async (trainer/run_dir/async_checkpoint.py): the write overlaps the next steps, training is
bitwise the synchronous run's, a resume from an asynchronous checkpoint continues it bitwise, and a process
killed before its save was published resumes from the checkpoint before."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import fast_train_overrides
from parallel.dims import init_distributed
from trainer.run_dir.async_checkpoint import CheckpointSaver
from trainer.run_dir.checkpoint import latest_checkpoint, verify_checkpoint
from trainer.config import ConfigError, load_config
from trainer.trainer import Trainer

ASYNC = {"checkpoint.async_mode": "async", "train.ckpt_every": 2}


def train(overrides):
    return Trainer(load_config(overrides), init_distributed()).fit()


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_async_saves_train_and_resume_bitwise_like_synchronous_saves(tmp_path, tiny_dataset):
    synchronous, background, resumed = tmp_path / "sync", tmp_path / "async", tmp_path / "resumed"
    train(fast_train_overrides(synchronous, tiny_dataset, steps=4, **{"train.ckpt_every": 2}))
    train(fast_train_overrides(background, tiny_dataset, steps=4, **ASYNC))
    assert losses(background) == losses(synchronous)
    log = (background / "train.log").read_text()
    # step 2's checkpoint was written while step 3 trained, and published after it
    assert log.index("step_00000002 writing in the background") < log.index("step 3/4") < log.index(
        "step_00000002 written")
    for step in (2, 4):
        assert verify_checkpoint(background / "checkpoints" / f"step_{step:08d}")["step"] == step
    assert not list((background / "checkpoints").glob(".tmp-*"))

    # Step 2's checkpoint, written in the background while step 3 changed the weights, resumes bitwise.
    train(fast_train_overrides(resumed, tiny_dataset, steps=4, resume=str(background / "checkpoints" / "step_00000002"),
                               **ASYNC))
    assert losses(resumed) == {step: loss for step, loss in losses(synchronous).items() if step > 2}


@pytest.mark.slow
def test_a_save_still_in_flight_when_the_next_is_due_is_published_and_logged_first(tmp_path, tiny_dataset,
                                                                                   monkeypatch):
    # Every poll finds the write unfinished, as a slow disk would: step 2's save is still in flight at step 4.
    monkeypatch.setattr(CheckpointSaver, "poll", lambda self: None)
    run = tmp_path / "run"
    train(fast_train_overrides(run, tiny_dataset, steps=4, **ASYNC))
    lines = [line.split(" ", 2)[2] for line in (run / "train.log").read_text().splitlines() if "checkpoint " in line]
    checkpoints = run / "checkpoints"
    saved = (2, 3, 4)  # ckpt_every=2, the wsd schedule's pre-decay step 3, and the last
    assert lines == [f"checkpoint {checkpoints / f'step_{step:08d}'}{end}"
                     for step in saved for end in (" writing in the background", " written")]
    for step in saved:
        assert verify_checkpoint(checkpoints / f"step_{step:08d}")["step"] == step


@pytest.mark.slow
def test_a_process_killed_with_a_save_in_flight_resumes_from_the_previous_checkpoint(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    overrides = fast_train_overrides(run, tiny_dataset, steps=6, **ASYNC)
    # debug.crash_at_step=4 SIGKILLs the process right after step 4's save was handed to the background and
    # before the next poll could publish it: no cleanup runs, the write threads die wherever they are.
    crashed = subprocess.run([sys.executable, "-m", "trainer.main", *overrides, "debug.crash_at_step=4"],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert "step_00000004 writing in the background" in (run / "train.log").read_text()
    assert latest_checkpoint(run).name == "step_00000002"
    assert not (run / "checkpoints" / "step_00000004").exists()  # at most its .tmp-step_00000004

    trainer = Trainer(load_config(overrides), init_distributed())
    assert trainer.resumed.path == run / "checkpoints" / "step_00000002"
    trainer.fit()
    reference = tmp_path / "uninterrupted"
    train(fast_train_overrides(reference, tiny_dataset, steps=6, **ASYNC))
    assert losses(run) == losses(reference)
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_pinned_staging_without_cuda_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        load_config(["checkpoint.async_mode=async_pinned"])
    assert str(refused.value) == ("checkpoint.async_mode=async_pinned stages into pinned host memory, which needs a "
                                  "CUDA device; this machine has none: use checkpoint.async_mode=async")


def test_closing_the_saver_releases_its_gloo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        groups_before = set(dist.distributed_c10d._world.pg_map)
        saver = CheckpointSaver("async", torch.device("cpu"))
        assert saver.group in dist.distributed_c10d._world.pg_map
        saver.close()
        assert set(dist.distributed_c10d._world.pg_map) == groups_before
    finally:
        dist.destroy_process_group()
