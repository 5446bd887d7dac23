"""Hang diagnosis (trainer/hang.py, parallel.*_timeout_s): a step that overruns train.hang_after_s gets the
process's stacks written and one line naming the rank and the step; the collective timeout reaches every
process group. The 2-rank case (one rank sleeps, both write their stacks) is in test_trainer.py's DDP launch."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import fast_train_overrides
from parallel.dims import init_distributed, set_collective_timeout
from trainer.config import ConfigError, load_config
from trainer.hang import HangWatchdog
from trainer.trainer import Trainer


@pytest.mark.slow
def test_a_step_that_sleeps_past_hang_after_s_leaves_its_stacks_and_a_line(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    overrides = fast_train_overrides(run, tiny_dataset, steps=2, **{"train.hang_after_s": 1.5, "debug.sleep_at_step": 2,
                                                                    "debug.sleep_s": 3})
    Trainer(load_config(overrides), init_distributed()).fit()
    stacks = (run / "hang" / "rank0_step2.txt").read_text()
    # the training thread, caught asleep inside step 2, and the watchdog's own thread writing them
    assert "in _maybe_sleep" in stacks and "in train_step" in stacks and "Current thread" in stacks
    [line] = [line for line in (run / "train.log").read_text().splitlines() if "hang: rank 0, step 2 " in line]
    assert line.endswith(f"more than 1.5 s (train.hang_after_s); the stacks of its threads are in {run / 'hang' / 'rank0_step2.txt'}")


def test_the_default_limit_is_ten_median_steps_and_at_least_five_minutes(tmp_path):
    watchdog = HangWatchdog(tmp_path / "hang", 0, None, print)
    try:
        assert watchdog.limit() == 300.0  # before any step has finished
        watchdog.durations = [1.0, 2.0, 100.0]
        assert watchdog.limit() == 300.0
        watchdog.durations = [40.0, 50.0, 900.0]
        assert watchdog.limit() == 500.0
    finally:
        watchdog.close()


def test_the_collective_timeout_reaches_every_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=600))
    try:
        checkpoint_group = dist.new_group(backend="gloo")  # as the asynchronous checkpoint writer makes its own
        set_collective_timeout(7)
        for group in (dist.group.WORLD, checkpoint_group):
            assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=7)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("override, message", [
    ("train.hang_after_s=0", "train.hang_after_s=0.0 must be a positive finite number of seconds or null"),
    ("parallel.collective_timeout_s=-1", "parallel.collective_timeout_s=-1.0 must be a positive finite number of seconds"),
])
def test_bad_limits_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as refused:
        load_config([override])
    assert str(refused.value) == message
