"""Host memory while one tp/ep rank gets its initial weights: filled as slices vs built whole and sliced.

`sliced`: sliced on meta and filled one init unit at a time (parallel.parallelize.materialise_parallel,
what every layout does); `whole`: built whole on the host and sliced afterwards (what it did before).

Each measurement is a fresh process (ru_maxrss is a per-process high-water mark) that first
materialises model=xs once, so the allocator's and torch's one-time start-up costs are paid before
the RSS baseline is read, and that runs with MALLOC_MMAP_THRESHOLD_ fixed so freed blocks leave the
RSS instead of staying in glibc's heap. `growth` is the peak RSS minus the RSS before the model is
given weights; `keeps` is the fp32 bytes of the rank's slices, `whole` those of the whole model.

    python -m scripts.bench host_memory [model=s] [tp=2] [ep=8] [repeats=3]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass

from scripts.bench.common import in_fresh_process, peak_rss_bytes, rss_bytes
from scripts.cli import key, parse

MODES = ("sliced", "whole")


@dataclass
class Args:
    model: str = key("s", "configs/model/ size")
    tp: int = key(2, "tensor-parallel degree of the rank")
    ep: int = key(8, "expert-parallel degree of the rank")
    repeats: int = key(3, "fresh processes per mode, modes interleaved")
    one: str | None = key(None, "internal: measure this mode in this process", choices=(None, *MODES))


def measure(mode: str, model_name: str, tp: int, ep: int) -> dict:
    """One measurement, in this process (run by main in a fresh one)."""
    import torch

    from model import build_model
    from model.init import materialise
    from parallel.dims import Degrees, DistInfo, Layout
    from parallel.parallelize import materialise_parallel, slice_model
    from trainer.config import load_config

    layout = Layout(degrees=Degrees(tp=tp, ep=ep))  # rank 0 of each group; no process group is needed to slice
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    warm_up = build_model(load_config(["model=xs"]), device="meta")
    materialise_parallel(warm_up, info, Layout(degrees=Degrees(tp=tp)), 0, torch.float32)  # model=xs has too few experts for ep=8
    del warm_up

    model = build_model(load_config([f"model={model_name}", "variant=block"]), device="meta")
    whole = 4 * sum(p.numel() for p in model.parameters())
    before = rss_bytes()
    if mode == "sliced":
        materialise_parallel(model, info, layout, 0, torch.float32)
    else:
        materialise(model, "cpu", model.cfg.init_stds, 0)
        slice_model(model, layout)
    peak = peak_rss_bytes()
    keeps = 4 * sum(p.numel() for p in model.parameters())
    return {"mode": mode, "whole_mb": whole / 1e6, "keeps_mb": keeps / 1e6, "growth_mb": (peak - before) / 1e6}


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    if args.one:
        print(json.dumps(measure(args.one, args.model, args.tp, args.ep)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    results = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:  # interleaved, so drift on the machine hits both alike
            command = ["-m", "scripts.bench", "host_memory", f"one={mode}", f"model={args.model}", f"tp={args.tp}",
                       f"ep={args.ep}"]
            results[mode].append(in_fresh_process(command, env, f"the {mode} measurement"))
            print(f"repeat {repeat + 1}/{args.repeats} {mode}: {results[mode][-1]['growth_mb']:.1f} MB", file=sys.stderr)
    first = results["sliced"][0]
    print(f"model={args.model} as rank 0 of tp={args.tp} x ep={args.ep}: whole model {first['whole_mb']:.1f} MB "
          f"fp32, this rank keeps {first['keeps_mb']:.1f} MB; {args.repeats} fresh processes per mode")
    print(f"{'mode':8s} {'growth MB (median)':>19s} {'min..max':>14s}")
    for mode in MODES:
        growth = [r["growth_mb"] for r in results[mode]]
        print(f"{mode:8s} {statistics.median(growth):19.1f} {min(growth):6.1f}..{max(growth):<6.1f}")

