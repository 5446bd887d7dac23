"""Step time under pipeline parallelism: Block AttnRes with the cross-stage cache on and off, and the
baseline, interleaved round by round in one launch; peak memory per rank. --compile runs every case
with train.compile=true (the warm-up step compiles, the timed rounds do not).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m scripts.bench_pp [--model s] [--rounds 4] [--compile]
        [overrides...]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.dims import init_distributed
from trainer.config import load_config
from trainer.metrics import peak_memory_mb
from trainer.trainer import Trainer

CASES = {
    "baseline": ["variant=baseline"],
    "block, cache on": ["variant=block", "parallel.pp_cache=true"],
    "block, cache off": ["variant=block", "parallel.pp_cache=false"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="s")
    parser.add_argument("--parallel", default="pp2_vp2")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--compile", action="store_true", help="train.compile=true for every case")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    info = init_distributed()
    tmp = Path(tempfile.mkdtemp(prefix="bench_pp_")) if info.is_main else None
    holder = [str(tmp)]
    dist.broadcast_object_list(holder)
    trainers = {}
    for name, overrides in CASES.items():
        cfg = load_config([f"model={args.model}", f"parallel={args.parallel}", f"run.dir={holder[0]}/{len(trainers)}",
                           "logging.wandb.mode=disabled", f"train.compile={str(args.compile).lower()}", *overrides,
                           *args.overrides])
        trainers[name] = Trainer(cfg, info)
    # Warm-up; compiled, a second step too: MoE expert sizes change between steps and recompile once with
    # dynamic shapes.
    for _ in range(2 if args.compile else 1):
        for trainer in trainers.values():
            trainer.train_step()
    times = {name: [] for name in trainers}
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            times[name].append(trainer.train_step()["step_time_s"])
    memory = [None] * info.world_size
    dist.all_gather_object(memory, peak_memory_mb(info.device))
    if info.is_main:
        t = cfg.train
        print(f"model={args.model} parallel={args.parallel} seq_len={t.seq_len} micro_batch={t.micro_batch} "
              f"global_batch={t.global_batch} rounds={args.rounds} world={info.world_size} "
              f"threads/rank={torch.get_num_threads()} compile={args.compile}")
        base = statistics.median(times["baseline"])
        print(f"{'case':<18}{'step (s)':>10}{'vs baseline':>13}")
        for name, samples in times.items():
            print(f"{name:<18}{statistics.median(samples):>10.3f}{statistics.median(samples) / base:>13.3f}")
        print("peak memory per rank (MB, process RSS over all cases): " + ", ".join(f"{m:,.0f}" for m in memory))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
