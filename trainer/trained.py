"""A trained run, for the tools that study one (export, depth_matrix, reskip, retrofit): its config, its
model with the checkpoint's weights, and the same validation windows the trainer evaluates on."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model import build_model
from trainer.run_dir.checkpoint import CheckpointError, check_model_shapes, load_checkpoint, resolve_checkpoint, verify_checkpoint
from trainer.config import Config, ConfigError, config_from_saved
from trainer.data import open_samples


@dataclass
class TrainedRun:
    checkpoint: Path
    meta: dict
    cfg: Config
    model: torch.nn.Module

    @property
    def step(self) -> int | None:
        return self.meta.get("step")

    def validation_batches(self, batches: int, micro_batch: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first `batches` of the trainer's fixed validation samples, (inputs, targets) pairs."""
        cfg = self.cfg
        samples = open_samples(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.seed)
        return list(samples.val_batches(micro_batch or cfg.train.micro_batch, batches))


def run_config(checkpoint: Path, meta: dict) -> Config:
    if "config" not in meta:
        raise CheckpointError(f"checkpoint {checkpoint} has no config in its meta.json; cannot tell which model to build")
    try:
        return config_from_saved(meta["config"])
    except ConfigError as error:
        raise CheckpointError(f"checkpoint {checkpoint} has a config this trainer cannot read ({error})") from None


def load_trained(checkpoint_or_run: str | Path) -> TrainedRun:
    """The run's model (fp32, eval mode, on the CPU) with the weights of `checkpoint_or_run`: a checkpoint
    directory, or a run directory (its newest checkpoint). The checkpoint's files are verified, and the
    shapes its config builds checked against its weights, before the model is allocated."""
    path = resolve_checkpoint(checkpoint_or_run)
    meta = verify_checkpoint(path)
    cfg = run_config(path, meta)
    check_model_shapes(path, cfg.model)
    model = build_model(cfg)
    load_checkpoint(path, model, [], None, rank=0, verify=False)
    return TrainedRun(path, meta, cfg, model.eval())
