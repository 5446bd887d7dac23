"""train.hang_after_s: a watchdog thread on every rank that writes the Python stacks of all the process's threads
(faulthandler) to <run.dir>/hang/rank<R>_step<S>.txt when one training step (its evaluation and checkpoint
included) runs longer than the limit, and reports one line naming the rank and the step.

A rank that hangs holds up the others at their next collective, so every rank's step overruns and every
rank writes its stacks: the file of the rank that hung shows where it is, the others show the collective
they wait in. The default limit is 10 x the median step of this launch, at least 300 s (300 s before a step
has finished). Each step is reported once; the process is left running (parallel.collective_timeout_s ends
a collective that never completes).
"""
from __future__ import annotations

import faulthandler
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from trainer.files.safe_io import LinkedPathError, write_file

LEAST_DEFAULT_S = 300.0
MEDIANS = 10


class HangWatchdog:
    def __init__(self, hang_dir: Path, rank: int, hang_after_s: float | None, report: Callable[[str], None]):
        self.hang_dir, self.rank, self.hang_after_s, self.report = hang_dir, rank, hang_after_s, report
        self.durations: list[float] = []
        self.running: tuple[int, float] | None = None  # (step, monotonic start)
        self.reported_step: int | None = None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self.thread.start()

    def limit(self) -> float:
        if self.hang_after_s is not None:
            return self.hang_after_s
        if not self.durations:
            return LEAST_DEFAULT_S
        return max(LEAST_DEFAULT_S, MEDIANS * statistics.median(self.durations))

    def start(self, step: int) -> None:
        with self.lock:
            self.running = (step, time.monotonic())

    def finish(self) -> None:
        with self.lock:
            if self.running is not None:
                self.durations.append(time.monotonic() - self.running[1])
            self.running = None

    @contextmanager
    def paused(self):
        """The running step's clock stops inside the block (work that is no part of a step's time)."""
        with self.lock:
            running, self.running = self.running, None
        paused_at = time.monotonic()
        try:
            yield
        finally:
            with self.lock:
                if running is not None:
                    step, started = running
                    self.running = (step, started + time.monotonic() - paused_at)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self.stopping.wait(min(1.0, self.limit() / 4)):
            with self.lock:
                running, limit = self.running, self.limit()
            if running is None or running[0] == self.reported_step:
                continue
            step, started = running
            elapsed = time.monotonic() - started
            if elapsed > limit:
                self.reported_step = step
                try:
                    stacks = f"the stacks of its threads are in {self._dump(step)}"
                except LinkedPathError as error:  # reported: raised, it would end the watchdog in a traceback
                    stacks = f"its stacks were not written: {error}"
                self.report(f"hang: rank {self.rank}, step {step} has run {elapsed:.1f} s, more than {limit:.1f} s "
                            f"(train.hang_after_s); {stacks}")

    def _dump(self, step: int) -> Path:
        """faulthandler writes through a file descriptor; the text then goes in with write_file (temp + rename,
        never through a symlink), hang/ made and reached from the run directory (its parent) without following
        a link planted since the start."""
        with tempfile.TemporaryFile() as scratch:
            faulthandler.dump_traceback(file=scratch, all_threads=True)
            scratch.seek(0)
            stacks = scratch.read()
        path = self.hang_dir / f"rank{self.rank}_step{step}.txt"
        write_file(path, stacks, root=self.hang_dir.parent)
        return path
