"""Long-context benchmark of context parallelism: peak memory per rank and step time against sequence length.

For each cp degree one torchrun launch of cp processes (gloo) trains one sequence of each length through
the real engine (build_engine with parallel.cp): forward, backward and DDP's gradient averaging over the cp
ranks. Memory is measured, not estimated: every tensor storage created during the step is tracked
(scripts/bench/memory.py's StorageTracker: activations, their gradients, the all-gathered buffers and the
parameter gradients; not the parameters), and the peak is the largest over the ranks. The loss column
is the step's loss minus cp=1's at the same length (context parallelism is exact, so about 1e-6).

Lengths run in increasing order; a length whose predicted peak times cp exceeds machine_gib is skipped, so
the benchmark cannot exhaust the machine. The prediction extrapolates the last measured peak by the power of
the length that the last two measured (between 1, linear, and 2, attention's T x T), or by 2 after one.
The summary gives, for each memory budget per rank (budget_gib, several allowed), the longest measured
length each cp fits in it.

    python -m scripts.bench context [model=s] [variant=block] [seq=[2048,4096,8192,16384,32768]]
                                    [cp=[1,2,4]] [budget_gib=[1,2,4]] [machine_gib=16] [repeats=3]
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import build_model
from parallel.dims import Degrees, build_layout, init_distributed
from parallel.engine import build_engine
from scripts.bench.common import random_tokens
from scripts.bench.memory import StorageTracker
from scripts.cli import fail, key, parse
from trainer.config import ParallelConfig, load_config

GIB = 2 ** 30


@dataclass
class Args:
    model: str = key("s", "configs/model/ size")
    variant: str = key("block", "configs/variant/ residual variant")
    seq: list[int] = key([2048, 4096, 8192, 16384, 32768], "sequence lengths, each divisible by every cp")
    cp: list[int] = key([1, 2, 4], "context-parallel degrees, one torchrun launch each")
    budget_gib: list[float] = key([1.0, 2.0, 4.0], "memory budgets per rank for the summary line")
    machine_gib: float = key(16.0, "skip a length whose predicted peak times cp exceeds this")
    repeats: int = key(3, "timed steps per length")
    threads: int = key(os.cpu_count() or 1, "cores shared by the cp processes of a launch")
    worker: bool = key(False, "internal: this process is one rank of a launch")


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def measure(args, seq: int, info) -> dict:
    """One sequence of `seq` tokens through the engine under cp = world size: peak bytes, step seconds, loss."""
    cp = info.world_size
    config = load_config([f"model={args.model}", f"variant={args.variant}"])
    model = build_model(config)
    layout = build_layout(info, Degrees(cp=cp))
    engine = build_engine(model, info, layout, ParallelConfig(cp=cp), micro_batch=1, seq_len=seq, microbatches=1)
    tokens = random_tokens(config.model.vocab_size, (1, seq + 1))
    batch = [(tokens[:, :-1], tokens[:, 1:])]

    def step() -> float:
        loss = engine.forward_backward(batch, contextlib.nullcontext, None)
        engine.model.zero_grad(set_to_none=True)
        return loss.item()

    with StorageTracker(engine.model) as tracker:
        loss = step()
    peak = _max_over_ranks(tracker.peak)
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        seconds.append(_max_over_ranks(time.perf_counter() - start))
    return {"cp": cp, "seq": seq, "peak_bytes": peak, "seconds": seconds, "loss": loss}


def worker(args) -> None:
    info = init_distributed()
    torch.set_num_threads(max(1, args.threads // info.world_size))
    measured = []
    for seq in sorted(args.seq):
        if measured:
            last = measured[-1]
            power = 2.0
            if len(measured) > 1:
                before = measured[-2]
                power = math.log(last["peak_bytes"] / before["peak_bytes"]) / math.log(last["seq"] / before["seq"])
                power = min(2.0, max(1.0, power))
            predicted = last["peak_bytes"] * (seq / last["seq"]) ** power
            if predicted * info.world_size > args.machine_gib * GIB:
                result = {"cp": info.world_size, "seq": seq, "skipped_predicted_bytes": predicted}
                if info.is_main:
                    print("RESULT " + json.dumps(result), flush=True)
                continue
        measured.append(measure(args, seq, info))
        if info.is_main:
            print("RESULT " + json.dumps(measured[-1]), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(args, argv: list[str], cp: int) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
               "-m", "scripts.bench", "context", "worker=true", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // cp))}
    process = subprocess.run(command, capture_output=True, text=True, env=env)
    if process.returncode:
        sys.exit(f"scripts.bench context: the cp={cp} launch failed:\n{process.stderr[-3000:]}")
    return [json.loads(line[7:]) for line in process.stdout.splitlines() if line.startswith("RESULT ")]


def _longest_within(rows: list[dict], budget_gib: float) -> str:
    fitting = [r["seq"] for r in rows if "peak_bytes" in r and r["peak_bytes"] <= budget_gib * GIB]
    return str(max(fitting)) if fitting else "none"


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    bad = [seq for seq in args.seq for cp in args.cp if seq % cp]
    if bad:
        fail(f"seq={bad[0]} is not divisible by every cp in {args.cp}")
    if args.worker:
        worker(args)
        return

    results = {cp: launch(args, argv, cp) for cp in args.cp}
    reference = {r["seq"]: r["loss"] for r in results.get(1, []) if "loss" in r}
    print(f"model={args.model} variant={args.variant}, one sequence per step, fp32 on "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'} ({args.threads} cores shared by a launch's ranks); "
          f"peak: most tensor bytes alive on one rank during forward+backward")
    print(f"{'cp':>3} {'seq':>6} {'peak GiB/rank':>14} {'x cp1':>6} {'step s (median [min, max])':>28} "
          f"{'tokens/s':>9} {'loss - cp1':>11}")
    for cp, rows in results.items():
        for row in rows:
            if "skipped_predicted_bytes" in row:
                print(f"{cp:>3} {row['seq']:>6} {'skipped':>14} (predicted {row['skipped_predicted_bytes'] / GIB:.1f} "
                      f"GiB per rank x {cp} ranks > machine_gib={args.machine_gib:g})")
                continue
            single = next((r for r in results.get(1, []) if r["seq"] == row["seq"] and "peak_bytes" in r), None)
            ratio = f"{row['peak_bytes'] / single['peak_bytes']:.2f}" if single else "-"
            median = statistics.median(row["seconds"])
            spread = f"{median:.2f} [{min(row['seconds']):.2f}, {max(row['seconds']):.2f}]"
            delta = f"{row['loss'] - reference[row['seq']]:+.1e}" if row["seq"] in reference else "-"
            print(f"{cp:>3} {row['seq']:>6} {row['peak_bytes'] / GIB:>14.3f} {ratio:>6} {spread:>28} "
                  f"{row['seq'] / median:>9.0f} {delta:>11}")
    print("longest measured sequence within a budget per rank: "
          + "; ".join(f"{budget:g} GiB: " + ", ".join(f"cp{cp} {_longest_within(rows, budget)}"
                                                        for cp, rows in results.items())
                      for budget in args.budget_gib))

