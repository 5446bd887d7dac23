"""What a run writes for its user: strict JSON lines (null for NaN), diagnostics only in their own file,
each step once after a crash, plain progress lines and train.log without a terminal, nothing from a
launch that does not train."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import fast_train_overrides
from parallel.dims import init_distributed
from trainer.config import load_config
from trainer.metrics import keep_rows_up_to
from trainer.trainer import Trainer

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "


def train(overrides):
    return Trainer(load_config(overrides), init_distributed()).fit()


def launch(overrides):
    """python -m trainer.main in a child process, its stderr a pipe (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "trainer.main", *overrides], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def strict_rows(path):
    """Every line parsed as strict JSON: a bare NaN or Infinity fails."""
    def refuse(constant):
        raise ValueError(f"{path.name} holds {constant}, which is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory, tiny_dataset):
    """Steps 1..3 with a NaN loss and NaN gradients at step 3, a diagnostics step."""
    run = tmp_path_factory.mktemp("nan") / "run"
    train(fast_train_overrides(run, tiny_dataset, steps=3, **{"debug.nan_loss_steps": "[3]"}))
    return run


def test_non_finite_numbers_are_written_as_null(nan_run):
    rows = {row["step"]: row for row in strict_rows(nan_run / "metrics.jsonl")}
    assert rows[3]["loss"] is None and rows[3]["grad_norm"] is None and rows[3]["skipped_steps"] == 1
    assert rows[2]["loss"] > 0 and rows[3]["val_loss"] > 0
    (diagnostics,) = strict_rows(nan_run / "diagnostics.jsonl")
    assert diagnostics["step"] == 3 and set(diagnostics["grad_rms"].values()) == {None}
    assert all(value > 0 for value in diagnostics["output_rms"].values())


def test_metrics_rows_hold_flat_numbers_and_no_diagnostics(nan_run):
    rows = [json.loads(line) for line in (nan_run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert "diagnostics" not in row
        assert all(value is None or isinstance(value, (int, float)) for value in row.values()), row


@pytest.mark.slow
def test_steps_rerun_after_a_crash_are_logged_once(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    overrides = fast_train_overrides(run, tiny_dataset, steps=6, **{"train.diag_every": 2})
    crashed = launch([*overrides, "debug.crash_at_step=4"])  # dies after logging step 4; checkpoint at 3
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert [row["step"] for row in strict_rows(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [row["step"] for row in strict_rows(run / "diagnostics.jsonl")] == [2, 4]
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 4.')  # a process killed in the middle of a write
    train(overrides)  # resumes from step 3
    assert [row["step"] for row in strict_rows(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert [row["step"] for row in strict_rows(run / "diagnostics.jsonl")] == [2, 4, 6]
    log = (run / "train.log").read_text()
    assert "metrics.jsonl: dropped 1 row after step 3 (this launch runs those steps again)" in log
    assert "metrics.jsonl: dropped a truncated last line (a run killed mid-write): '{\"step\": 5, \"loss\": 4.'" in log
    assert "diagnostics.jsonl: dropped 1 row after step 3" in log
    assert not list(run.glob("*.tmp"))


def test_keep_rows_up_to_keeps_rows_without_a_step_and_leaves_a_clean_file_untouched(tmp_path):
    path = tmp_path / "metrics.jsonl"
    clean = '{"step": 1, "loss": 5.0}\n{"note": "no step"}\n{"step": 2, "pp_comm": {"pp": 2}}\n'
    path.write_text(clean + '{"step": 3, "loss": 4.0}\n{"step": 4, "loss": 3.0}\n')
    assert keep_rows_up_to(path, 2) == ["metrics.jsonl: dropped 2 rows after step 2 (this launch runs those steps again)"]
    assert path.read_text() == clean
    before = path.stat().st_mtime_ns
    assert keep_rows_up_to(path, 2) == []
    assert path.stat().st_mtime_ns == before


@pytest.mark.slow
def test_without_a_terminal_summary_lines_carry_step_of_total_and_eta_and_train_log_keeps_them(
        tmp_path, tiny_dataset):
    run = tmp_path / "run"
    first = launch(fast_train_overrides(run, tiny_dataset, steps=4, **{"train.stop_after": 2}))
    assert first.returncode == 0, first.stderr[-2000:]
    assert "\r" not in first.stderr  # no progress bar redrawn into a file
    lines = first.stderr.splitlines()
    step_lines = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in step_lines] == ["step 1/4", "step 2/4"]
    assert all(re.search(r" \| ETA \d+:\d\d:\d\d$", line) for line in step_lines), step_lines
    train(fast_train_overrides(run, tiny_dataset, steps=4))  # the second launch appends
    log = (run / "train.log").read_text().splitlines()
    assert all(re.match(STAMP, line) for line in log), log
    texts = [line[20:] for line in log]
    assert texts[:len(lines)] == lines  # everything the first launch printed, in order
    announces = [text for text in texts if text.startswith(f"run {run}: model=")]
    assert len(announces) == 2 and announces[1].endswith("step 2/4, resumed from "
                                                         f"{run / 'checkpoints' / 'step_00000002'}")
    summaries = [text for text in texts if text.startswith("step ")]
    assert [text.split(" | ")[0] for text in summaries] == [f"step {s}/4" for s in range(1, 5)]
    assert summaries[-1].endswith(" | ETA 0:00:00")
    assert texts[-1] == f"checkpoint {run / 'checkpoints' / 'step_00000004'}"


@pytest.mark.slow
def test_a_launch_that_does_not_train_writes_nothing(tmp_path, tiny_dataset, capfd):
    run = tmp_path / "run"
    overrides = fast_train_overrides(run, tiny_dataset, steps=3)
    train(overrides)
    written = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "diagnostics.jsonl", "train.log")}
    capfd.readouterr()
    train(overrides)
    assert "run already complete at step 3/3" in capfd.readouterr().err
    assert {name: (run / name).read_bytes() for name in written} == written
