"""Step time under pipeline parallelism of Block AttnRes, cross-stage cache on and off, and the baseline.

The cases are interleaved round by round in one launch; peak memory per rank. compile=true runs every case
with train.compile=true (the warm-up step compiles, the timed rounds do not).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m scripts.bench pp [model=s] [rounds=4]
        [compile=true] [trainer overrides...]
"""
from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.dims import init_distributed
from scripts.bench.common import interleaved
from scripts.cli import key, one_line_errors, parse
from trainer.config import ConfigError, load_config
from trainer.metrics import peak_memory_mb
from trainer.trainer import Trainer

CASES = {
    "baseline": ["variant=baseline"],
    "block, cache on": ["variant=block", "parallel.pp_cache=true"],
    "block, cache off": ["variant=block", "parallel.pp_cache=false"],
}


@dataclass
class Args:
    model: str = key("s", "configs/model/ size")
    parallel: str = key("pp2_vp2", "configs/parallel/ layout")
    rounds: int = key(4, "timed rounds, every case once per round")
    compile: bool = key(False, "train.compile=true for every case")


def main(argv: list[str]) -> None:
    args, overrides = parse(Args, __doc__, argv, trainer_overrides=True)
    with one_line_errors(ConfigError):
        configs = {name: load_config([f"model={args.model}", f"parallel={args.parallel}", "logging.wandb.mode=disabled",
                                      f"train.compile={str(args.compile).lower()}", *case, *overrides])
                   for name, case in CASES.items()}
    info = init_distributed()
    holder = [tempfile.mkdtemp(prefix="bench_pp_") if info.is_main else None]
    dist.broadcast_object_list(holder)
    trainers = {}
    for index, (name, cfg) in enumerate(configs.items()):
        cfg.run.dir = f"{holder[0]}/{index}"
        trainers[name] = Trainer(cfg, info)
    # Warm-up; compiled, a second step too: MoE expert sizes change between steps and recompile once with
    # dynamic shapes.
    times = interleaved({name: lambda t=trainer: t.train_step()["step_time_s"] for name, trainer in trainers.items()},
                        args.rounds, warmup=2 if args.compile else 1)
    memory = [None] * info.world_size
    dist.all_gather_object(memory, peak_memory_mb(info.device))
    if info.is_main:
        t = configs["baseline"].train
        print(f"model={args.model} parallel={args.parallel} seq_len={t.seq_len} micro_batch={t.micro_batch} "
              f"global_batch={t.global_batch} rounds={args.rounds} world={info.world_size} "
              f"threads/rank={torch.get_num_threads()} compile={args.compile}")
        base = statistics.median(times["baseline"])
        print(f"{'case':<18}{'step (s)':>10}{'vs baseline':>13}")
        for name, samples in times.items():
            print(f"{name:<18}{statistics.median(samples):>10.3f}{statistics.median(samples) / base:>13.3f}")
        print("peak memory per rank (MB, process RSS over all cases): " + ", ".join(f"{m:,.0f}" for m in memory))
    dist.destroy_process_group()

