"""What data preparation says on stderr: one-off lines, and progress over the input bytes and documents."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

# Without a terminal a redrawn bar is noise in a log; a plain line this often says the same.
LINE_INTERVAL_S = 30.0


def log(message: str) -> None:
    print(f"[prepare_data] {message}", file=sys.stderr, flush=True)


def eta(done: int, total: int, seconds: float) -> str:
    if done <= 0 or done >= total:
        return "?" if done <= 0 else "0s"
    left = seconds * (total - done) / done
    return f"{left / 60:.0f}min" if left >= 120 else f"{left:.0f}s"


class Progress:
    """Bytes read of `total` and documents tokenised: a tqdm bar on a terminal (its ETA and rate), else a
    plain line every LINE_INTERVAL_S seconds with the same figures."""

    def __init__(self, total: int, description: str):
        self.total, self.description = total, description
        self.done = self.documents = 0
        self.start = self.last = time.monotonic()
        self.bar = (tqdm(total=total, desc=f"[prepare_data] {description}", unit="B", unit_scale=True, file=sys.stderr)
                    if sys.stderr.isatty() else None)

    def update(self, amount: int, documents: int) -> None:
        self.done += amount
        self.documents += documents
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.documents:,} documents", refresh=False)
            self.bar.update(amount)
            return
        now = time.monotonic()
        if now - self.last >= LINE_INTERVAL_S:
            self.last = now
            seconds = max(now - self.start, 1e-9)
            log(f"{self.description}: {self.done / 1e6:.1f} / {self.total / 1e6:.1f} MB "
                f"({100 * self.done / max(self.total, 1):.0f}%, {self.done / seconds / 1e6:.1f} MB/s), "
                f"{self.documents:,} documents, ETA {eta(self.done, self.total, seconds)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
