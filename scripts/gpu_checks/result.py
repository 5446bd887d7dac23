"""What every check of scripts/gpu_check.sh shares: its command line (out=DIR, rehearse=true) and its result file.

A check writes <out>/result.json: its status (PASS | FAIL | SKIP), its figures, what it skipped (each entry
names what it would have measured) and its one summary line, which it also prints last.
rehearse=true runs the check on the CPU with tiny shapes: the same code, files and summary; only the steps that
need CUDA are skipped, each naming what it would have measured.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from scripts.cli import fail, key, parse

RESULT_FILE = "result.json"


@dataclass
class CheckArgs:
    out: str | None = key(None, "this check's folder, for result.json and its files (required)")
    rehearse: bool = key(False, "on the CPU with tiny shapes; CUDA-only steps SKIP")


class Checking(NamedTuple):
    out: Path
    rehearse: bool
    device: torch.device


def parse_args(doc: str, argv: list[str] | None = None) -> Checking:
    args = parse(CheckArgs, doc, argv)
    if not args.out:
        fail("out= is required: this check's folder, for result.json and its files")
    if not args.rehearse and not torch.cuda.is_available():
        fail("no CUDA device is visible (torch.cuda.is_available() is False); rehearse=true runs on the CPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rehearse:
        # Tiny shapes gain nothing from a second thread, and OpenMP threads spin at their barriers whenever
        # other work holds a core (a shared CI machine): steps measured 10x slower with two.
        torch.set_num_threads(1)
    return Checking(out, args.rehearse, torch.device("cpu" if args.rehearse else "cuda"))


@dataclass
class Result:
    check: str
    figures: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)   # what a rehearsal did not measure, one entry per step
    problems: list[str] = field(default_factory=list)  # any entry fails the check

    def skip(self, what: str) -> None:
        self.skipped.append(what)

    @property
    def status(self) -> str:
        if self.problems:
            return "FAIL"
        return "SKIP" if self.skipped and not self.figures else "PASS"

    def line(self, figures: str) -> str:
        details = "; ".join(self.problems) if self.problems else figures
        skipped = f" (skipped {len(self.skipped)}: {'; '.join(self.skipped)})" if self.skipped else ""
        return f"{self.status} {self.check} {details}{skipped}"

    def finish(self, out: Path, figures: str) -> None:
        """Write result.json, print the summary line and exit non-zero on FAIL."""
        line = self.line(figures)
        (out / RESULT_FILE).write_text(json.dumps({**asdict(self), "status": self.status, "line": line}, indent=1))
        print(line)
        sys.exit(1 if self.problems else 0)
