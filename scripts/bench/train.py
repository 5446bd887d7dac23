"""Full training step of baseline vs Full vs Block inside the real Trainer, and the trainer's own overhead.

The step is the trainer's whole one (data, forward, backward, clip, optimizer, MoE bias), the variants
interleaved in one process; the overhead is data loading and metrics writing as a fraction of the step.

    python -m scripts.bench train [model=s] [rounds=6] [trainer overrides...]
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from parallel.dims import init_distributed
from scripts.bench.common import interleaved
from scripts.cli import key, one_line_errors, parse
from trainer.config import ConfigError, load_config
from trainer.metrics import MetricsLogger, summary_line
from trainer.trainer import Trainer

VARIANTS = ("baseline", "full", "block")


@dataclass
class Args:
    model: str = key("s", "configs/model/ size")
    rounds: int = key(6, "timed rounds, every variant once per round")


def main(argv: list[str]) -> None:
    args, overrides = parse(Args, __doc__, argv, trainer_overrides=True)
    with tempfile.TemporaryDirectory() as tmp:
        with one_line_errors(ConfigError):
            configs = {variant: load_config([f"model={args.model}", f"variant={variant}", f"run.dir={Path(tmp) / variant}",
                                             "logging.wandb.mode=disabled", "train.diag_every=1000000", *overrides])
                       for variant in VARIANTS}
        info = init_distributed()
        trainers = {variant: Trainer(cfg, info) for variant, cfg in configs.items()}
        loggers = {variant: MetricsLogger(cfg, trainers[variant].run_dir, True, 0) for variant, cfg in configs.items()}
        for logger in loggers.values():
            logger.bar.disable = True

        def timed_step(variant: str) -> tuple[float, float, float]:
            """(step, data, logging) seconds of one training step."""
            record = trainers[variant].train_step()
            start = time.perf_counter()
            loggers[variant].log(record)
            summary_line(record)
            return record["step_time_s"], record["data_time_s"], time.perf_counter() - start

        rounds = interleaved({v: lambda v=v: timed_step(v) for v in VARIANTS}, args.rounds)
        step, data, logging = ({v: [r[i] for r in rounds[v]] for v in VARIANTS} for i in range(3))
        for logger in loggers.values():
            logger.close()
    cfg = configs["block"]
    train = cfg.train
    print(f"model={args.model} seq_len={train.seq_len} micro_batch={train.micro_batch} "
          f"global_batch={train.global_batch} optim={cfg.optim.name} rounds={args.rounds} "
          f"threads={torch.get_num_threads()}")
    base = statistics.median(step["baseline"])
    print(f"{'variant':<10}{'step (s)':>10}{'ratio':>8}{'data %':>9}{'logging %':>11}")
    for variant in VARIANTS:
        s = statistics.median(step[variant])
        print(f"{variant:<10}{s:>10.3f}{s / base:>8.3f}{100 * statistics.median(data[variant]) / s:>9.2f}"
              f"{100 * statistics.median(logging[variant]) / s:>11.3f}")

