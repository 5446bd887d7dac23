"""What the benchmarks share: a model of a size and variant, seeded tokens, torch's threads, cases timed in
interleaved rounds (so drift in machine load hits every case alike), a median and its range printed alike,
and a measurement in a fresh process (peak RSS is a per-process high-water mark)."""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, TypeVar

import torch

from model import build_model
from trainer.config import load_config

T = TypeVar("T")


def bench_model(model: str, *overrides: str):
    """The Decoder of configs/model/<model>.yaml with further trainer overrides (variant=block ...)."""
    return build_model(load_config([f"model={model}", *overrides]))


def random_tokens(vocab: int, shape: tuple[int, ...], low: int = 0) -> torch.Tensor:
    """Token ids in [low, vocab), the same on every call and every rank."""
    return torch.randint(low, vocab, shape, generator=torch.Generator().manual_seed(0))


def set_threads(threads: int) -> None:
    """torch's intra-op threads; 0 leaves them as they are."""
    if threads:
        torch.set_num_threads(threads)


def seconds(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def interleaved(cases: dict[str, Callable[[], T]], rounds: int, warmup: int = 1) -> dict[str, list[T]]:
    """case -> what its callable returned in each of `rounds` rounds, every case once per round, after
    `warmup` untimed rounds."""
    for _ in range(warmup):
        for work in cases.values():
            work()
    results = {name: [] for name in cases}
    for _ in range(rounds):
        for name, work in cases.items():
            results[name].append(work())
    return results


def spread(values: list[float], digits: int) -> str:
    """'median [min, max]'."""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def rss_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def in_fresh_process(command: list[str], env: dict[str, str], what: str) -> dict:
    """Run `command` (python -m ... in a new interpreter) and read the JSON of its last stdout line; a
    failure exits naming `what` and the last line of its stderr."""
    done = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"{what} failed: {(done.stderr.strip().splitlines() or ['(no output)'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
