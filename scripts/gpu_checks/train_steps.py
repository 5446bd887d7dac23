"""30 bf16 training steps of model=m for the baseline and Block, through the trainer: step-time ratio
and peak memory, MFU against the device's peak, a profiler trace of Block's last two steps (with CUDA
kernels in it); then Block resumes from its last checkpoint on the device for 2 more steps. On CUDA
train.precision=auto means bf16 (autocast; parallel.dims.resolve_precision), so no flag is needed.
The device may have no network, so the text is generated here (pseudo-words; the trainer trains its
BPE on it) instead of the default Shakespeare download.

    python -m scripts.gpu_checks.train_steps --out runs/gpu_check/train    (last line: PASS|FAIL train_bf16_m ...)
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = ("baseline", "block")
WARMUP_STEPS = 10  # compile-free, but the first steps still pay allocator and cuBLAS warm-up


def write_corpus(texts: Path, files: int = 40, lines: int = 400) -> None:
    """Seeded pseudo-English: 4000 random words, enough distinct pairs for an 8192-token BPE."""
    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choices(letters, weights=range(26, 0, -1), k=rng.randint(2, 9))) for _ in range(4000)]
    texts.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        body = (" ".join(rng.choices(words, k=rng.randint(6, 16))).capitalize() + "." for _ in range(lines))
        (texts / f"doc{i:02d}.txt").write_text("\n".join(body) + "\n")


def train(variant: str, out: Path, steps: int, resume: bool = False, extra: tuple[str, ...] = ()) -> list[dict]:
    """Train (or, with `resume`, continue the run to `steps`) and return its step records."""
    run_dir = out / f"run_{variant}"
    # Extending a finished WSD run moves its decay, so the resumed leg allows the LR change.
    resumed = ["resume=auto", "train.allow_lr_change=true"] if resume else ["resume=never"]
    overrides = ["model=m", f"variant={variant}", f"run.dir={run_dir}", *resumed,
                 f"data.path={out / 'texts'}", f"data.cache_dir={out / 'data_cache'}", f"train.steps={steps}",
                 "train.seq_len=1024", "train.micro_batch=16", "train.global_batch=16", "train.log_every=1",
                 f"train.eval_every={steps}", "train.eval_batches=2", f"train.ckpt_every={10 * steps}",
                 f"train.diag_every={10 * steps}", "train.warmup_steps=5", "logging.wandb.mode=disabled", *extra]
    result = subprocess.run([sys.executable, "-m", "trainer.main", *overrides], capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{variant} exited {result.returncode}: {tail[0]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "step_time_s" in r]


def _has_cuda_kernels(trace: Path) -> bool:
    """Whether the profiler recorded device activity (StepProfiler adds CUDA on a CUDA device)."""
    if not trace.is_file():
        return False
    events = json.loads(trace.read_text()).get("traceEvents", [])
    return any(event.get("cat") == "kernel" for event in events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check/train"))
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    write_corpus(args.out / "texts")
    figures, problems = {}, []
    profiled = (args.steps - 1, args.steps)  # the last two steps: the median step time barely moves
    for variant in VARIANTS:
        extra = (f"debug.profile_steps=[{profiled[0]},{profiled[1]}]",) if variant == "block" else ()
        try:
            steps = train(variant, args.out, args.steps, extra=extra)
        except RuntimeError as error:
            problems.append(str(error))
            continue
        timed = steps[WARMUP_STEPS:] or steps
        figures[variant] = (statistics.median(r["step_time_s"] for r in timed), max(r["peak_mem_mb"] for r in steps))
        if len(steps) != args.steps or not all(math.isfinite(r["loss"]) for r in steps):
            problems.append(f"{variant}: {len(steps)} of {args.steps} steps logged, or a non-finite loss")
        if steps[-1].get("mfu") is None:
            problems.append(f"{variant}: mfu is null (the device's name is not in trainer/mfu.py's table)")
        print(f"  {variant}: median step {figures[variant][0] * 1e3:.1f} ms (steps {WARMUP_STEPS + 1}-{len(steps)}), "
              f"peak {figures[variant][1]:.0f} MB, loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}")
    trace = args.out / "run_block" / "profile" / f"rank0_steps{profiled[0]}-{profiled[1]}.json"
    if "block" in figures and not _has_cuda_kernels(trace):
        problems.append(f"profile: {trace} is missing or holds no CUDA kernel events")
    if not problems:
        # Resume on the device: the checkpoint's CUDA RNG state is restored (Trainer's CPU tests cover
        # only the CPU generator), then two more steps must train.
        try:
            more = [r for r in train("block", args.out, args.steps + 2, resume=True) if r["step"] > args.steps]
            if len(more) != 2 or not all(math.isfinite(r["loss"]) for r in more):
                problems.append(f"resume: {len(more)} of 2 steps after step {args.steps} logged, or a non-finite loss")
        except RuntimeError as error:
            problems.append(f"resume: {error}")
    if problems:
        print(f"FAIL train_bf16_m {'; '.join(problems)}")
        sys.exit(1)
    (base_s, base_mb), (block_s, block_mb) = figures["baseline"], figures["block"]
    print(f"PASS train_bf16_m steps={args.steps} resumed+2 baseline={base_s * 1e3:.1f}ms block={block_s * 1e3:.1f}ms "
          f"ratio={block_s / base_s:.3f}x peak_mem baseline={base_mb:.0f}MB block={block_mb:.0f}MB "
          f"({block_mb / base_mb:.3f}x)")


if __name__ == "__main__":
    main()
