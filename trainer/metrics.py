"""What the user sees: a progress bar and summary lines on rank 0, metrics.jsonl, diagnostics.jsonl, wandb."""
from __future__ import annotations

import json
import os
import math
import resource
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from trainer.config import Config


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux: the process's resident peak, the closest CPU analogue.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def entropy(weights: list[float]) -> float:
    return -sum(w * math.log(w) for w in weights if w > 0)


class MetricsLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, start_step: int):
        self.enabled = enabled
        self.wandb_run = None
        self.bar = None
        if not enabled:
            return
        self.metrics_path = run_dir / "metrics.jsonl"
        self.diagnostics_path = run_dir / "diagnostics.jsonl"
        self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", unit="step",
                        dynamic_ncols=True, file=sys.stderr, disable=None)
        if cfg.logging.wandb.mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb
            from omegaconf import OmegaConf

            self.wandb_run = wandb.init(
                project=cfg.logging.wandb.project, name=cfg.logging.wandb.name or run_dir.name,
                mode=cfg.logging.wandb.mode, dir=str(run_dir), config=OmegaConf.to_container(OmegaConf.structured(cfg)),
                resume="allow", id=_wandb_id(run_dir))

    def print(self, line: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(line, file=sys.stderr)

    def advance(self, loss: float, tokens_per_s: float) -> None:
        if self.enabled:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def log_diagnostics(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.diagnostics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            flat = {f"diag/output_rms/{k}": v for k, v in record["output_rms"].items()}
            flat.update({f"diag/grad_rms/{k}": v for k, v in record["grad_rms"].items()})
            flat.update({f"diag/depth_entropy/{k}": v for k, v in record.get("depth_entropy", {}).items()})
            self.wandb_run.log(flat, step=record["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _wandb_id(run_dir: Path) -> str:
    """A stable id per run directory, so a resumed run continues the same wandb run."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


def summary_line(record: dict) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f}")
    parts += [f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}",
              f"{record['tokens_per_s']:,.0f} tok/s", f"{record['step_time_s']:.2f} s/step",
              f"mem {record['peak_mem_mb']:,.0f} MB", f"moe imb {record['moe_load_imbalance']:.2f}"]
    return " | ".join(parts)
