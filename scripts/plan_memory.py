"""Plan the memory per rank of a training layout (parallel/memory_plan.py), or find the layouts that fit.

    python -m scripts.plan_memory model=kimi_linear_48b parallel.fsdp=8 parallel.ep=8 train.seq_len=4096 \
        train.micro_batch=1 gpus=64 gpu_mem_gib=80 [train.activation_checkpointing=full] [search=true]
    python -m scripts.plan_memory model=kimi_linear_48b train.seq_len=131072 train.micro_batch=1 \
        variant.two_phase=false gpus=64 gpu_mem_gib=80 search=true   # 128K tokens: fits with parallel.cp
    python -m scripts.plan_memory check_cpu=true     # real CPU runs at model=m, planned vs measured peak

Keys other than the planner's own are the trainer's overrides (trainer.config.load_config); parallel.* are read
by the planner itself,
so layouts the trainer refuses today can still be planned (the output says whether it runs them).
Without train.global_batch the pipeline is planned in its steady state (enough microbatches to fill it).
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from parallel.dims import Degrees
from parallel.memory_plan import GIB, MIB, MODES, Plan, plan, search
from scripts.cli import key, parse
from trainer.config import ConfigError, load_config, validate

LAYOUT_KEYS = ("dp", "fsdp", "cp", "pp", "vp", "tp", "ep")
STEADY_STATE = 1 << 20  # microbatches when train.global_batch is not given


class PlanError(ValueError):
    """Bad input; the message is one line."""


def refusal(cfg, layout: Degrees) -> str | None:
    """The trainer's verdict on this layout (None: it runs it today): the config's own checks, then the
    layout's rules (`Degrees.problems`; the batch is the planner's, checked by `check_layout`)."""
    trial = copy.deepcopy(cfg)
    trial.parallel.dp, trial.parallel.fsdp, trial.parallel.pp = layout.dp, layout.fsdp, layout.pp
    trial.parallel.vp, trial.parallel.tp, trial.parallel.ep = layout.vp, layout.tp, layout.ep
    trial.parallel.cp = layout.cp
    if layout.vp > 1 and trial.parallel.schedule not in ("interleaved_1f1b", "zero_bubble"):
        trial.parallel.schedule = "interleaved_1f1b"
    if layout.vp == 1 and layout.pp > 1 and trial.parallel.schedule == "interleaved_1f1b":
        trial.parallel.schedule = "1f1b"
    try:
        validate(trial)
    except ConfigError as error:
        return str(error)
    problems = layout.problems(cfg.model, cfg.train.seq_len)
    return problems[0] if problems else None


def parse_layout(overrides: list[str], gpus: int) -> tuple[Degrees, list[str]]:
    values, rest = {}, []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.startswith("parallel.") and key.removeprefix("parallel.") in LAYOUT_KEYS:
            if value in ("null", "None"):
                continue
            try:
                values[key.removeprefix("parallel.")] = int(value)
            except ValueError:
                raise PlanError(f"{key}={value!r} must be a positive integer") from None
            if values[key.removeprefix("parallel.")] < 1:
                raise PlanError(f"{key}={value} must be a positive integer")
        else:
            rest.append(item)
    ranks = values.get("fsdp", 1) * values.get("cp", 1) * values.get("pp", 1) * values.get("tp", 1)
    if gpus % ranks:
        raise PlanError(f"gpus={gpus} is not divisible by parallel.fsdp * parallel.cp * parallel.pp * parallel.tp "
                        f"= {ranks}")
    values.setdefault("dp", gpus // ranks)
    layout = Degrees(**values)
    if layout.world != gpus:
        raise PlanError(f"parallel.dp * fsdp * cp * pp * tp = {layout.world} does not match gpus={gpus}")
    return layout, rest


def check_layout(cfg, layout: Degrees, explicit_batch: bool) -> None:
    """The layout's rules (`Degrees.problems`), the batch's only where it was given."""
    t = cfg.train
    problems = (layout.problems(cfg.model, t.seq_len, t.micro_batch, t.global_batch) if explicit_batch
                else layout.problems(cfg.model, t.seq_len))
    if problems:
        raise PlanError(problems[0])


def microbatches_of(cfg, layout: Degrees, explicit_batch: bool) -> int:
    if not explicit_batch:
        return STEADY_STATE
    return cfg.train.global_batch // (cfg.train.micro_batch * layout.data_ranks)


def gib(n: float) -> str:
    return f"{n / GIB:9.2f} GiB"


def report(p: Plan, budget: float, gpu_bytes: float, headroom: float, refused: str | None) -> list[str]:
    lay = p.layout
    lines = [f"layout {lay.name()}: dp={lay.dp} fsdp={lay.fsdp} cp={lay.cp} pp={lay.pp} vp={lay.vp} tp={lay.tp} "
             f"ep={lay.ep}; device {p.device}; planned rank: pipeline stage {p.stage} of {lay.pp}",
             f"  parameters held        {p.params / 1e9:9.3f} B (before fsdp x cp)",
             f"  parameters             {gib(p.param_bytes)}",
             f"  gradients              {gib(p.grad_bytes)}",
             f"  optimizer state        {gib(p.optimizer_bytes)}  (AdamW, fp32 moments)"]
    if p.ddp_bucket_bytes:
        lines.append(f"  DDP gradient buckets   {gib(p.ddp_bucket_bytes)}")
    if p.autocast_copy_bytes:
        lines.append(f"  bf16 weight copies     {gib(p.autocast_copy_bytes)}  (autocast, kept for backward)")
    for mode in MODES:
        mark = "  <-" if mode == p.mode else ""
        lines.append(f"  activations {mode:<10} {gib(p.activations_by_mode[mode])}{mark}")
    lines += [f"    per microbatch       {gib(p.activation_per_microbatch)}"
              + (f"  (the last of {lay.cp} cp ranks: its slice's queries see every key)" if lay.cp > 1 else ""),
              f"    in flight            {p.in_flight:9.2f} microbatches (pipeline stage {p.stage})",
              f"    AttnRes block storage{gib(p.depth_state_bytes)}  (included above)",
              f"  transient              {gib(p.transient_bytes)}  (fsdp unit gathered x2 for prefetch + its "
              "unsharded grads, + gloo's staging of both on CPU; one recomputed block)",
              f"  optimizer step temps   {gib(p.optimizer_step_bytes)}  (after backward)"]
    if p.runtime_bytes:
        lines.append(f"  process runtime        {gib(p.runtime_bytes)}  (measured: python + torch + model code)")
    lines.append(f"  total                  {gib(p.total_bytes)}")
    if p.host_start_bytes:
        lines.append(f"  host RAM at start-up   {gib(p.host_start_bytes)} per rank (at most one unit drawn in fp32 on "
                     "the host while the initial weights are filled)")
    verdict = "fits" if p.total_bytes <= budget else "does not fit"
    lines.append(f"{verdict}: {p.total_bytes / GIB:.2f} GiB of {budget / GIB:.2f} GiB usable "
                 f"({gpu_bytes / GIB:.0f} GiB less {headroom:.0%} headroom for fragmentation and NCCL buffers)")
    lines.append("trainer today: runs it" if refused is None else f"trainer today: refused ({refused})")
    return lines


def run_plan(args, overrides: list[str]) -> None:
    layout, rest = parse_layout(overrides, args.gpus)
    cfg = load_config(rest)
    explicit = any(o.startswith("train.global_batch=") for o in rest)
    check_layout(cfg, layout, explicit)
    gpu_bytes = args.gpu_mem_gib * GIB
    budget = gpu_bytes * (1 - args.headroom)
    if args.search:
        global_batch = cfg.train.global_batch if explicit else cfg.train.micro_batch * args.gpus * 8
        found = search(cfg.model, gpus=args.gpus, gpu_bytes=gpu_bytes, headroom=args.headroom, seq_len=cfg.train.seq_len,
                       micro_batch=cfg.train.micro_batch, global_batch=global_batch, device=args.device,
                       capacity=args.capacity, precision=cfg.train.precision, float8=cfg.train.float8)
        found = [(p, refusal(cfg, p.layout)) for p in found]
        if args.runnable:
            found = [(p, refused) for p, refused in found if refused is None]
        print(f"{len(found)} layouts fit {args.gpus} x {args.gpu_mem_gib:g} GiB at seq_len={cfg.train.seq_len} "
              f"micro_batch={cfg.train.micro_batch} global_batch={global_batch} (best first: fewest pipeline chunks, "
              f"then none < selective < full recomputation, then least tp, then least cp, then least memory; "
              f"host GiB: RAM per rank at start-up)")
        print(f"{'layout':<28} {'cp':>3} {'ckpt':<10} {'total GiB':>9} {'host GiB':>8}  trainer today")
        for p, refused in found[:args.top]:
            print(f"{p.layout.name():<28} {p.layout.cp:>3} {p.mode:<10} {p.total_bytes / GIB:9.2f} "
                  f"{p.host_start_bytes / GIB:8.1f}  {'runs' if refused is None else 'refused: ' + refused}")
        return
    p = plan(cfg.model, layout, seq_len=cfg.train.seq_len, micro_batch=cfg.train.micro_batch,
             microbatches=microbatches_of(cfg, layout, explicit), mode=cfg.train.activation_checkpointing,
             device=args.device, capacity=args.capacity, runtime_bytes=args.runtime_mib * MIB,
             precision=cfg.train.precision, float8=cfg.train.float8)
    print(f"model={cfg.model.d_model}d x {cfg.model.n_blocks} blocks, seq_len={cfg.train.seq_len} "
          f"micro_batch={cfg.train.micro_batch}, moe capacity {args.capacity if layout.ep > 1 else 1.0} (ep only)")
    print("\n".join(report(p, budget, gpu_bytes, args.headroom, refusal(cfg, layout))))


# -- planned vs measured on CPU ----------------------------------------------------------------------

CPU_RUNS = (("single", 1, []), ("dp2", 2, ["parallel=dp2"]), ("fsdp2", 2, ["parallel=fsdp2"]),
            ("pp2", 2, ["parallel=pp2", "parallel.schedule=1f1b", "parallel.vp=1"]),
            ("fsdp2_tp2", 4, ["parallel=fsdp2_tp2"]))
# cosine: a WSD run saves a checkpoint where its decay starts (step 2 of 3), and that save would enter the peak.
CPU_TRAIN = ["model=m", "train.seq_len=128", "train.micro_batch=2", "train.global_batch=8", "train.steps=3",
             "train.schedule=cosine", "train.warmup_steps=1",
             "train.log_every=1", "train.eval_every=1000", "train.ckpt_every=1000", "train.diag_every=1000",
             "logging.wandb.mode=disabled"]


def runtime_rss_mib() -> float:
    """Peak RSS of a process that imports torch and the model and trainer code and builds nothing."""
    code = ("import resource, torch, model, trainer.trainer, parallel.engine; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def measured_peak_mib(name: str, nproc: int, extra: list[str], mode: str, workdir: Path) -> tuple[float, float]:
    run_dir = workdir / f"{name}-{mode}"
    overrides = CPU_TRAIN + extra + [f"train.activation_checkpointing={mode}", f"run.dir={run_dir}"]
    # A fixed mmap threshold makes glibc return freed large blocks, so ru_maxrss follows the live bytes
    # (its default raises the threshold after the first frees and keeps freed activations in the heap:
    # +7-14% at model=m, docs/BENCHMARKS.md).
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    if nproc == 1:
        cmd = [sys.executable, "-m", "trainer.main", *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "trainer.main", *overrides]
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "peak_mem_mb" in r]  # pp also writes its communication volume (pp_comm)
    return max(r["peak_mem_mb"] for r in rows), rows[-1]["step_time_s"]  # the first steps warm up


def check_cpu(args) -> None:
    runtime = runtime_rss_mib()
    print(f"process runtime (import torch + model + trainer, nothing built): {runtime:.0f} MiB, added to every plan")
    print(f"load: {os.getloadavg()[0]:.2f} (1-min average)")
    cfg = load_config(CPU_TRAIN)
    print(f"{'layout':<8} {'ckpt':<6} {'planned MiB':>11} {'measured MiB':>12} {'ratio':>6} {'step s':>7} "
          f"{'state MiB':>9} {'load':>5}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, nproc, extra in [run for run in CPU_RUNS if run[0] in args.layouts]:
            layout = {"single": Degrees(), "dp2": Degrees(dp=2), "fsdp2": Degrees(fsdp=2),
                      "pp2": Degrees(pp=2), "fsdp2_tp2": Degrees(fsdp=2, tp=2)}[name]
            for mode in ("none", "full"):
                p = plan(cfg.model, layout, seq_len=cfg.train.seq_len, micro_batch=cfg.train.micro_batch,
                         microbatches=microbatches_of(cfg, layout, explicit_batch=True), mode=mode,
                         device="cpu", runtime_bytes=runtime * MIB, stage=0)  # rank 0 writes metrics.jsonl
                measured, step = measured_peak_mib(name, nproc, extra, mode, Path(tmp))
                planned = p.total_bytes / MIB
                state = (p.param_bytes + p.grad_bytes + p.optimizer_bytes) / MIB
                print(f"{name:<8} {mode:<6} {planned:>11.0f} {measured:>12.0f} {planned / measured:>6.2f} {step:>7.2f} "
                      f"{state:>9.0f} {os.getloadavg()[0]:>5.2f}", flush=True)


@dataclass
class Args:
    gpus: int = key(1, "devices in the job")
    gpu_mem_gib: float = key(80.0, "memory per device")
    headroom: float = key(0.10, "share of device memory kept free (fragmentation, NCCL buffers)")
    device: str = key("cuda", "the plan's device", choices=("cuda", "cpu"))
    capacity: float = key(1.25, "routed rows per ep rank over the mean (load imbalance), ep > 1 only")
    runtime_mib: float = key(0.0, "process baseline added to the plan (CPU)")
    search: bool = key(False, "list the layouts that fit, best first")
    runnable: bool = key(False, "search=true: only layouts the trainer accepts today")
    top: int = key(20, "search=true: how many layouts to list")
    check_cpu: bool = key(False, "real CPU runs at model=m: planned vs measured")
    layouts: list[str] = key(["single", "dp2", "fsdp2", "pp2"], "check_cpu=true: which runs",
                             choices=tuple(run[0] for run in CPU_RUNS))


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(Args, __doc__, argv, trainer_overrides=True)
    try:
        if args.gpus < 1 or args.gpu_mem_gib <= 0 or not 0 <= args.headroom < 1:
            raise PlanError(f"gpus={args.gpus} must be >= 1, gpu_mem_gib={args.gpu_mem_gib:g} > 0 and "
                            f"headroom={args.headroom:g} in [0, 1)")
        if args.check_cpu:
            check_cpu(args)
        else:
            run_plan(args, overrides)
    except (PlanError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
