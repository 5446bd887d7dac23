"""What data preparation says on stderr: one-off lines, and progress over the bytes being tokenised."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

# Without a terminal a redrawn bar is noise in a log; a plain line this often says the same.
LINE_INTERVAL_S = 30.0


def log(message: str) -> None:
    print(f"[prepare_data] {message}", file=sys.stderr, flush=True)


class ProgressLines:
    """tqdm's update/close, printed as a plain line every LINE_INTERVAL_S seconds."""

    def __init__(self, total: int, description: str):
        self.total, self.description = total, description
        self.done = 0
        self.start = self.last = time.monotonic()

    def update(self, amount: int) -> None:
        self.done += amount
        now = time.monotonic()
        if now - self.last >= LINE_INTERVAL_S:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            log(f"{self.description}: {self.done / 1e6:.1f} / {self.total / 1e6:.1f} MB "
                f"({100 * self.done / max(self.total, 1):.0f}%, {rate / 1e6:.1f} MB/s)")

    def close(self) -> None:
        pass


def byte_progress(total: int, description: str) -> tqdm | ProgressLines:
    """A progress bar over `total` input bytes on stderr: tqdm on a terminal, periodic lines otherwise."""
    if sys.stderr.isatty():
        return tqdm(total=total, desc=f"[prepare_data] {description}", unit="B", unit_scale=True, file=sys.stderr)
    return ProgressLines(total, description)
