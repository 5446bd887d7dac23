"""Fault drills: failures planted on purpose, so that the tests, and users rehearsing a failure before a long
run meets it, can watch what the trainer does about each. Every key is under `debug.` and off by default.

- `debug.crash_at_step=N`, `debug.crash_rank` (null: every rank): once N steps are done, before step N+1,
  the process SIGKILLs itself, as a node's OOM killer would: no cleanup runs, a checkpoint save in flight
  dies with it. A marker per rank in run.dir (`.crash_injected_rank<r>`) keeps the relaunch (resume=auto,
  or torchrun's restart) from crashing there again; it is removed once the run is past step N+1, so the run
  directory keeps no trace of the drill.
- `debug.nan_loss_steps=[...]`: those steps' loss and every gradient become NaN after the backward pass: the
  step is skipped (skipped_steps counts it), and train.max_bad_steps of them in a row stop the run.
- `debug.sleep_at_step=N`, `debug.sleep_s`, `debug.sleep_rank`: that rank sleeps sleep_s seconds inside
  step N, before its forward pass, while the other ranks wait for it in a collective: a planted hang, for
  the hang watchdog (train.hang_after_s) and the collective timeout (parallel.collective_timeout_s).

The training step meets the drills once, in FaultDrills.forward_backward; the loop calls before_step and
after_step around each step for the crash, which falls between steps.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from parallel.engine import Engine
from trainer.config import DebugConfig


class FaultDrills:
    def __init__(self, debug: DebugConfig, run_dir: Path, rank: int):
        self.debug, self.rank = debug, rank
        self.crash_marker = run_dir / f".crash_injected_rank{rank}"

    def before_step(self, steps_done: int) -> None:
        """debug.crash_at_step: SIGKILL this process once at that step, on debug.crash_rank or every rank."""
        debug = self.debug
        if (debug.crash_at_step is not None and steps_done == debug.crash_at_step
                and debug.crash_rank in (None, self.rank) and not self.crash_marker.exists()):
            self.crash_marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, steps_done: int) -> None:
        """Once past debug.crash_at_step the marker has done its job."""
        at = self.debug.crash_at_step
        if at is not None and steps_done > at:
            self.crash_marker.unlink(missing_ok=True)

    def forward_backward(self, engine: Engine, step: int, micro_batches, autocast, diagnostics: dict | None) -> float:
        """engine.forward_backward's loss for training step `step` (from 1), with this step's drills planted."""
        self._maybe_sleep(step)
        loss = engine.forward_backward(micro_batches, autocast, diagnostics).item()
        if step in self.debug.nan_loss_steps:
            loss = float("nan")
            for p in engine.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        return loss

    def _maybe_sleep(self, step: int) -> None:
        """Its own frame, so the planted hang is named in the stacks the hang watchdog writes."""
        if self.debug.sleep_at_step == step and self.rank == self.debug.sleep_rank:
            time.sleep(self.debug.sleep_s)
