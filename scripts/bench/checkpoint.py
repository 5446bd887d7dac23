"""Blocking time per checkpoint save, synchronous against asynchronous (checkpoint.async_mode), one process.

A model of the given size with AdamW state (one real step, so the moments exist) is saved `saves` times
per mode through the trainer's CheckpointSaver, modes interleaved so load drift hits all alike. `blocking`
is what the training loop waits for at a save: the whole save when synchronous; begin_save, the staging copy
and the hand-off when asynchronous (plus the wait for the previous save, none here: each async save is
published before the next starts). `written` is the time until the checkpoint is published (meta.json and
the rename done); for async that is the background write, hashing and publishing.

    python -m scripts.bench checkpoint [model=m] [saves=3] [modes=[off,async]] [dir=DIR]
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from model import build_model
from scripts.cli import key, parse
from trainer.config import load_config
from trainer.optim import build_optimizer, build_scheduler
from trainer.run_dir.async_checkpoint import CheckpointSaver


@dataclass
class Args:
    model: str = key("m", "configs/model/ size")
    saves: int = key(3, "saves per mode, modes interleaved")
    modes: list[str] = key(["off", "async"], "checkpoint.async_mode values to time",
                           choices=("off", "async", "async_pinned"))
    dir: str | None = key(None, "where to write (null: a temporary directory)")


def trained_state(model_name: str):
    """A model, its AdamW optimizer (moments filled by one step) and scheduler, and the config."""
    cfg = load_config([f"model={model_name}"])
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.train)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 17))  # (B, T + 1)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    scheduler.step()
    return cfg, model, optimizer, scheduler


def time_save(saver: CheckpointSaver, run_dir: Path, step: int, cfg, model, optimizer, scheduler) -> tuple[float, float]:
    """(blocking, written) seconds of one save."""
    start = time.perf_counter()
    saver.save(run_dir, step, model, optimizer.optimizers, scheduler, {"step": step},
               {"model_fingerprint": "bench", "config": asdict(cfg)}, keep_last=1)
    blocking = time.perf_counter() - start
    saver.wait()
    return blocking, time.perf_counter() - start


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    modes = args.modes
    cfg, model, optimizer, scheduler = trained_state(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    savers = {mode: CheckpointSaver(mode, torch.device("cpu")) for mode in modes}
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for save in range(1, args.saves + 1):
            for mode in modes:
                times[mode].append(time_save(savers[mode], Path(root) / mode, save, cfg, model, optimizer, scheduler))
    for saver in savers.values():
        saver.close()
    print(f"model={args.model}: {n_params / 1e6:.1f}M parameters, fp32 weights + AdamW moments, {args.saves} saves")
    for mode in modes:
        blocking = [b for b, _ in times[mode]]
        written = [w for _, w in times[mode]]
        print(f"async_mode={mode:<13} blocking {statistics.median(blocking):7.3f} s (runs {', '.join(f'{b:.3f}' for b in blocking)})"
              f" | written after {statistics.median(written):7.3f} s")

