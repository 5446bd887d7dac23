"""Full training step (data, forward, backward, clip, optimizer, MoE bias) of baseline vs Full vs
Block inside the real Trainer, interleaved in one process; also the trainer's own overhead (data
loading and metrics writing) as a fraction of the step.

    python -m scripts.bench_train [--model s] [--rounds 6] [hydra overrides...]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from parallel.dims import init_distributed
from trainer.config import load_config
from trainer.metrics import MetricsLogger, summary_line
from trainer.trainer import Trainer

VARIANTS = ("baseline", "full", "block")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="s")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    info = init_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        trainers, loggers = {}, {}
        for variant in VARIANTS:
            cfg = load_config([f"model={args.model}", f"variant={variant}", f"run.dir={Path(tmp) / variant}",
                               "logging.wandb.mode=disabled", "train.diag_every=1000000", *args.overrides])
            trainers[variant] = Trainer(cfg, info)
            loggers[variant] = MetricsLogger(cfg, trainers[variant].run_dir, True, 0)
            loggers[variant].bar.disable = True
        for trainer in trainers.values():  # warm-up
            trainer.train_step()
        step, data, logging = ({v: [] for v in VARIANTS} for _ in range(3))
        for _ in range(args.rounds):
            for variant, trainer in trainers.items():
                record = trainer.train_step()
                start = time.perf_counter()
                loggers[variant].log(record)
                summary_line(record)
                logging[variant].append(time.perf_counter() - start)
                step[variant].append(record["step_time_s"])
                data[variant].append(record["data_time_s"])
        for logger in loggers.values():
            logger.close()
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


if __name__ == "__main__":
    main()
