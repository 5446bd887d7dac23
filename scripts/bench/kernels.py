"""Fused AttnRes depth-read kernels vs the torch reference and torch.compile of it, forward+backward, on a GPU.

Also the achieved memory bandwidth against the device's peak. Needs a CUDA GPU (exits 0 without one).

    python -m scripts.bench kernels [dtype=bf16] [tokens=8192] [peak_gbps=4800] [reps=20]
                                    [dims=[1024,2304,4096]] [sources=[4,8,10]] [queries=[2,6]] [summary=true]

summary=true ends with one line for scripts/gpu_check.sh: PASS or FAIL, the worst row's speedup over
torch.compile, share of peak bandwidth and error, against the goals (goal_speedup, goal_peak_pct,
max_error); every row must meet all three.

Bandwidth counts the bytes a fused forward+backward must move at least (each tensor read or written
once per pass), so it is comparable across implementations: higher is better, the peak is the roof.
  phase 1: forward reads the N blocks, writes o (S x fp32); backward reads the blocks and d_o, writes
           the block gradients: (3 N e + 8 S) bytes per token and column (e: bytes per element).
  phase 2: forward reads o1 (fp32) and the partial sum, writes h; backward reads o1, the partial sum
           and d_h, writes d_o1 (fp32) and d_partial: (12 + 5 e) bytes per token and column.
"""
from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass

import torch

from kernels import attnres
from scripts.cli import key, parse

# Peak HBM bandwidth in GB/s by a substring of torch.cuda.get_device_name() (vendor data sheets).
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "A10G": 600,
             "RTX 4090": 1008}
DIMS, SOURCES, QUERIES = (1024, 2304, 4096), (4, 8, 10), (2, 6)
EPS = 1e-5


@dataclass
class Args:
    dtype: str = key("bf16", "the blocks' dtype", choices=("bf16", "fp32"))
    tokens: int = key(8192, "tokens per call")
    reps: int = key(20, "timed calls per row (median)")
    peak_gbps: float | None = key(None, "device peak GB/s (null: from the device's name)")
    dims: list[int] = key(list(DIMS), "model widths d")
    sources: list[int] = key(list(SOURCES), "phase 1's N (blocks read)")
    queries: list[int] = key(list(QUERIES), "phase 1's S (queries batched)")
    summary: bool = key(False, "end with one PASS/FAIL line against the goals")
    goal_speedup: float = key(1.4, "triton vs torch.compile, every row")
    goal_peak_pct: float = key(70.0, "% of peak bandwidth, every row")
    max_error: float = key(2e-2, "max relative error vs the reference")


def device_peak(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)


def time_ms(step, reps: int) -> float:
    """Median over reps of one call of step(), after warm-up (which also compiles)."""
    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def phase1_case(tokens: int, d: int, n: int, s: int, dtype: torch.dtype):
    """read(impl) -> the differentiable outputs; the inputs; cotangents; the bytes moved at least."""
    blocks = [torch.randn(1, tokens, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(n)]
    queries = (torch.randn(s, 1, d, device="cuda") * d ** -0.5).requires_grad_()

    def read(impl):
        return lambda: attnres.phase1(blocks, queries, EPS, impl=impl)[:3]

    cotangents = [torch.randn_like(out) for out in read("torch")()]
    nbytes = (3 * n * blocks[0].element_size() + 8 * s) * tokens * d
    return read, [queries, *blocks], cotangents, nbytes


def phase2_case(tokens: int, d: int, dtype: torch.dtype):
    o1 = torch.randn(1, tokens, d, device="cuda", requires_grad=True)
    m1 = torch.randn(1, tokens, 1, device="cuda", requires_grad=True)
    l1 = (torch.rand(1, tokens, 1, device="cuda") + 1).requires_grad_()
    partial = torch.randn(1, tokens, d, device="cuda", dtype=dtype, requires_grad=True)
    query = (torch.randn(1, d, device="cuda") * d ** -0.5).requires_grad_()

    def read(impl):
        return lambda: attnres.phase2(o1, m1, l1, partial, query, EPS, impl=impl)[:1]

    cotangents = [torch.randn_like(read("torch")()[0])]
    nbytes = (12 + 5 * partial.element_size()) * tokens * d
    return read, [o1, m1, l1, partial, query], cotangents, nbytes


def bench(read, inputs, cotangents, nbytes: int, reps: int, peak: float | None) -> dict:
    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(), inputs, cotangents)

    reference = read("torch")
    compiled = torch.compile(reference)
    fused = read("triton")
    error = max(((f - r).abs().max() / r.abs().max()).item() for f, r in zip(fused(), reference()))
    ms = {name: time_ms(fwd_bwd(fn), reps) for name, fn in
          (("reference", reference), ("compile", compiled), ("triton", fused))}
    gbps = nbytes / ms["triton"] / 1e6
    return {**ms, "speedup_vs_compile": ms["compile"] / ms["triton"], "gbps": gbps,
            "peak_pct": 100 * gbps / peak if peak else float("nan"), "max_rel_error": error}


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    if not torch.cuda.is_available():
        print("scripts.bench kernels needs a CUDA GPU; none found, nothing to measure.")
        sys.exit(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    name = torch.cuda.get_device_name()
    peak = device_peak(name, args.peak_gbps)
    print(f"{name}, peak {peak or '?'} GB/s, {args.dtype}, {args.tokens} tokens, forward+backward, median ms")
    print("| op | d | N | S | reference | compile | triton | vs compile | GB/s | % peak | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = ([("phase1", d, n, s) for d in args.dims for n in args.sources for s in args.queries]
            + [("phase2", d, 1, 1) for d in args.dims])
    results = []
    for op, d, n, s in rows:
        torch._dynamo.reset()  # a fresh compile per shape, as a training run of that shape would have
        case = phase1_case(args.tokens, d, n, s, dtype) if op == "phase1" else phase2_case(args.tokens, d, dtype)
        r = bench(*case, args.reps, peak)
        results.append(r)
        print(f"| {op} | {d} | {n} | {s} | {r['reference']:.3f} | {r['compile']:.3f} | {r['triton']:.3f} | "
              f"{r['speedup_vs_compile']:.2f}x | {r['gbps']:.0f} | {r['peak_pct']:.0f} | {r['max_rel_error']:.1e} |",
              flush=True)
        torch.cuda.empty_cache()
    if args.summary:
        line = summary_line(results, args)
        print(line)
        sys.exit(line.startswith("FAIL"))


def summary_line(results: list[dict], args) -> str:
    """PASS when every row meets the speedup and bandwidth goals within the error bound (no known peak: FAIL)."""
    speedup = min(r["speedup_vs_compile"] for r in results)
    peaks = [r["peak_pct"] for r in results]
    peak_pct = float("nan") if any(math.isnan(p) for p in peaks) else min(peaks)  # nan (peak unknown) fails
    error = max(r["max_rel_error"] for r in results)
    passed = speedup >= args.goal_speedup and peak_pct >= args.goal_peak_pct and error <= args.max_error
    return (f"{'PASS' if passed else 'FAIL'} bench_kernels rows={len(results)} min_vs_compile={speedup:.2f}x "
            f"(goal >= {args.goal_speedup}x) min_peak={peak_pct:.0f}% (goal >= {args.goal_peak_pct:.0f}%) "
            f"max_rel_error={error:.1e} (<= {args.max_error:.0e})")

