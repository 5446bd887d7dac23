"""The run lifecycle: one run per run directory, finished runs left alone, extending a wsd run without an
LR jump, and one-line errors for run directories that cannot be written or fill up."""
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import fast_train_overrides
from parallel.dims import init_distributed
from trainer import main as trainer_main_module
from trainer.check import main as check
from trainer.run_dir.checkpoint import latest_checkpoint
from trainer.config import ConfigError, load_config
from trainer.run_dir.lock import LOCK_FILE, RunDirError, RunDirLock
from trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def train(overrides):
    return Trainer(load_config(overrides), init_distributed()).fit()


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file under directory: relative path -> (sha256, mtime in ns)."""
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def trainer_main(overrides, **popen):
    command = [sys.executable, "-m", "trainer.main", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if popen:
        return subprocess.Popen(command, cwd=REPO, env=env, **popen)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@contextmanager
def tmpfs(mount_point: Path, options: str):
    """A real small filesystem (tests run as root); skipped where mounting is not permitted."""
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here ({mounted.stderr.strip()}); this test needs a real "
                    "small or read-only filesystem")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


# -- one run per directory ---------------------------------------------------------------------

@pytest.mark.slow
def test_second_run_on_a_locked_dir_is_refused_in_one_line_and_changes_nothing(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    train(fast_train_overrides(run, tiny_dataset, steps=6, **{"train.stop_after": 3}))
    first = Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=6)), init_distributed())
    before = snapshot(run)
    second = trainer_main(fast_train_overrides(run, tiny_dataset, steps=6))
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith(f"error: run.dir={run} is in use by another run: pid {os.getpid()} on "
                               f"{socket.gethostname()} (started ")
    assert lines[0].endswith("); wait for it to finish or stop it, or pick another run.dir")
    assert snapshot(run) == before
    first.fit()  # the first run was not disturbed
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert not (run / LOCK_FILE).exists()


def test_every_rank_of_a_second_torchrun_job_refuses_with_the_same_line(tmp_path, tiny_dataset, torchrun):
    run = tmp_path / "run"
    lock = RunDirLock(run).acquire()
    try:
        result = torchrun(fast_train_overrides(run, tiny_dataset, steps=4))
    finally:
        lock.release()
    refusals = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(refusals) == 2 and refusals[0] == refusals[1], result.stderr[-3000:]
    assert refusals[0].startswith(f"error: run.dir={run} is in use by another run: pid {os.getpid()} on ")
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr  # torchrun reports the first to exit
    assert list(run.iterdir()) == []


def test_the_error_line_is_one_write_so_ranks_sharing_stderr_cannot_interleave(monkeypatch):
    """Under PYTHONUNBUFFERED every write is its own syscall; print() made two (text, then newline), and
    two ranks' refusals came out joined on one line (CI, stop 21)."""
    writes = []

    class RecordingStderr:
        def write(self, text):
            writes.append(text)

    monkeypatch.setattr(sys, "stderr", RecordingStderr())
    with pytest.raises(SystemExit) as exit_info:
        trainer_main_module.fail("run.dir=x is in use")
    assert exit_info.value.code == 2
    assert writes == ["error: run.dir=x is in use\n"]


@pytest.mark.slow
def test_lock_of_a_killed_run_does_not_block_the_next_run(tmp_path, tiny_dataset, capfd):
    run = tmp_path / "run"
    overrides = fast_train_overrides(run, tiny_dataset, steps=200)
    killed = trainer_main(overrides, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while latest_checkpoint(run) is None and time.monotonic() < deadline and killed.poll() is None:
        time.sleep(0.1)
    killed.kill()  # SIGKILL: no cleanup runs
    killed.wait()
    assert latest_checkpoint(run) is not None
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == killed.pid
    capfd.readouterr()
    train([*overrides, "train.stop_after=1"])
    assert f"took over the lock of pid {killed.pid} on {socket.gethostname()}" in capfd.readouterr().err
    assert not (run / LOCK_FILE).exists()


def test_check_refuses_a_dir_a_live_run_holds(tmp_path, tiny_dataset, capsys):
    run = tmp_path / "run"
    lock = RunDirLock(run).acquire()
    try:
        with pytest.raises(SystemExit) as exit_info:
            check(["model=xs", f"data.path={tiny_dataset}", f"run.dir={run}"])
    finally:
        lock.release()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: run.dir={run} is in use by another run: pid {os.getpid()}")


@pytest.mark.slow
def test_crash_marker_is_gone_once_the_resumed_run_passes_the_step(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    overrides = fast_train_overrides(run, tiny_dataset, steps=4, **{"train.ckpt_every": 2, "debug.crash_at_step": 3})
    crashed = trainer_main(overrides)
    assert crashed.returncode == -signal.SIGKILL
    assert (run / ".crash_injected_rank0").is_file()
    train(overrides)  # resumes at step 2, passes step 3 without crashing again
    assert [r["step"] for r in metrics(run)][-2:] == [3, 4]
    assert not list(run.glob(".crash_injected_rank*"))


# -- finished runs, extending wsd runs -----------------------------------------------------------

@pytest.mark.slow
def test_relaunching_a_finished_run_changes_nothing(tmp_path, tiny_dataset, capfd):
    run = tmp_path / "run"
    train(fast_train_overrides(run, tiny_dataset, steps=4))
    before = snapshot(run)
    capfd.readouterr()
    assert train(fast_train_overrides(run, tiny_dataset, steps=4, **{"train.log_every": 2})) == {}
    assert snapshot(run) == before
    assert sorted(p.name for p in run.iterdir()) == sorted({name.split("/")[0] for name in before})
    assert f"run already complete at step 4/4, nothing changed in {run}; to train longer, extend it from its " \
           f"pre-decay checkpoint: resume={run}/checkpoints/step_00000003" in capfd.readouterr().err


@pytest.mark.slow
def test_wsd_run_extends_from_its_pre_decay_checkpoint_without_an_lr_jump(tmp_path, tiny_dataset):
    short, longer, extended = tmp_path / "short", tmp_path / "long", tmp_path / "extended"
    # steps=6, decay_fraction=0.2: 5 steps at the peak, 1 decay step. keep_last=1 would prune step 5.
    train(fast_train_overrides(short, tiny_dataset, steps=6, **{"train.keep_last": 1}))
    pre_decay = short / "checkpoints" / "step_00000005"
    assert sorted(p.name for p in (short / "checkpoints").glob("step_*")) == ["step_00000005", "step_00000006"]

    with pytest.raises(ConfigError) as refused:
        train(fast_train_overrides(short, tiny_dataset, steps=12))
    assert str(refused.value) == (
        f"resuming {short}/checkpoints/step_00000006 with train.steps=12 (checkpoint: 6) would move the lr from "
        f"0.0003 at step 6 to 0.003 at step 7; to extend a wsd run, resume from its pre-decay checkpoint: "
        f"resume={pre_decay} run.dir=<a new dir>, or set train.allow_lr_change=true to accept the jump")

    train(fast_train_overrides(longer, tiny_dataset, steps=12))
    train(fast_train_overrides(extended, tiny_dataset, steps=12, resume=str(pre_decay)))
    reference = {r["step"]: (r["lr"], r["loss"]) for r in metrics(longer)}
    continued = {r["step"]: (r["lr"], r["loss"]) for r in metrics(extended)}
    assert sorted(continued) == list(range(6, 13))
    assert continued == {step: reference[step] for step in continued}


@pytest.mark.slow
def test_allow_lr_change_extends_a_finished_run_at_the_new_schedules_lr(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    train(fast_train_overrides(run, tiny_dataset, steps=6))
    train(fast_train_overrides(run, tiny_dataset, steps=8, **{"train.allow_lr_change": "true"}))
    lrs = {r["step"]: r["lr"] for r in metrics(run)}
    # steps=8 decays over its last 2 steps: step 7 (update 6) is the first of them, at (1 - 0.9 / 2) * 3e-3.
    assert lrs[6] == pytest.approx(3e-4) and lrs[7] == pytest.approx(1.65e-3) and lrs[8] == pytest.approx(3e-4)


@pytest.mark.slow
def test_a_new_peak_lr_on_resume_is_refused_or_used_never_ignored(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    train(fast_train_overrides(run, tiny_dataset, steps=8, **{"train.stop_after": 3}))
    with pytest.raises(ConfigError) as refused:
        train(fast_train_overrides(run, tiny_dataset, steps=8, **{"optim.lr": 1e-3}))
    assert str(refused.value) == (
        f"resuming {run}/checkpoints/step_00000003 with peak lr 0.001 (optim.lr, optim.muon_lr) but it was trained "
        "at 0.003; drop the override, or set train.allow_lr_change=true to train on at the new peak")
    train(fast_train_overrides(run, tiny_dataset, steps=8, **{"optim.lr": 1e-3, "train.allow_lr_change": "true"}))
    lrs = {r["step"]: r["lr"] for r in metrics(run)}
    assert lrs[3] == pytest.approx(3e-3) and lrs[4] == pytest.approx(1e-3) and lrs[8] == pytest.approx(1e-4)


# -- run directories that cannot be written --------------------------------------------------------

@pytest.mark.slow
def test_run_dir_under_a_file_is_one_line_in_trainer_and_check(tmp_path, tiny_dataset, capsys):
    (tmp_path / "file").write_text("not a directory\n")
    run = tmp_path / "file" / "run"
    with pytest.raises(RunDirError) as refused:
        train(fast_train_overrides(run, tiny_dataset))
    assert str(refused.value) == (f"run.dir={run} cannot be created (Not a directory: {run}); "
                                  "pick a writable run.dir")
    launched = trainer_main(fast_train_overrides(run, tiny_dataset))  # Hydra must not create it first
    assert (launched.returncode, launched.stderr.strip()) == (2, f"error: {refused.value}")
    with pytest.raises(SystemExit):
        check(["model=xs", f"data.path={tiny_dataset}", f"run.dir={run}"])
    assert capsys.readouterr().err.strip() == (f"error: run.dir={run} cannot be created: {tmp_path / 'file'} "
                                               "is a file; pick another run.dir")


def test_read_only_run_dir_is_one_line_in_trainer_and_check(tmp_path, tiny_dataset, capsys):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as read_only:
        run = read_only / "run"
        with pytest.raises(RunDirError) as refused:
            train(fast_train_overrides(run, tiny_dataset))
        assert str(refused.value) == (f"run.dir={run} cannot be created (Read-only file system: {run}); "
                                      "pick a writable run.dir")
        with pytest.raises(SystemExit):
            check(["model=xs", f"data.path={tiny_dataset}", f"run.dir={run}"])
        assert capsys.readouterr().err.strip() == (f"error: run.dir={run} is not writable ({read_only} is "
                                                   "read-only to this user); pick a writable run.dir")


@pytest.mark.slow
def test_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, tiny_dataset):
    # One checkpoint of model=xs is ~11 MB: the one of step 3 fits in 20 MB, the one of step 6 does not.
    with tmpfs(tmp_path / "small", "size=20m") as small:
        run = small / "run"
        with pytest.raises(RunDirError) as refused:
            train(fast_train_overrides(run, tiny_dataset, steps=9))
        message = str(refused.value)
        assert message.startswith(f"no space left on the device of run.dir={run} at step 6 (")
        assert message.endswith(" MiB free); the previous checkpoints are kept (latest step_00000003); free some "
                                "space, then run again with resume=auto")
        assert not (run / LOCK_FILE).exists()
        kept = latest_checkpoint(run)
        assert kept.name == "step_00000003"
        # The kept checkpoint is intact: a run resumes from it (verified, since it is named) elsewhere.
        train(fast_train_overrides(tmp_path / "elsewhere", tiny_dataset, steps=4, resume=str(kept)))
    assert [r["step"] for r in metrics(tmp_path / "elsewhere")] == [4]


def test_trainer_and_check_refuse_a_run_dir_without_room_for_a_checkpoint(tmp_path, tiny_dataset, capsys):
    with tmpfs(tmp_path / "tiny", "size=1m") as tiny:
        refusal = (f"run.dir={tiny / 'run'} has 1.0 MiB free but one checkpoint of this model (0.9M parameters, "
                   "fp32 weights + AdamW moments) needs about 10.5 MiB; free some space or pick another run.dir")
        with pytest.raises(SystemExit) as exit_info:
            check(["model=xs", f"data.path={tiny_dataset}", f"run.dir={tiny / 'run'}"])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip() == f"error: {refusal}"
        assert list(tiny.iterdir()) == []
        with pytest.raises(RunDirError) as refused:  # before any step: not after the first one, at the first save
            train(fast_train_overrides(tiny / "run", tiny_dataset))
        assert str(refused.value) == refusal
        assert sorted(p.name for p in (tiny / "run").iterdir()) == []
