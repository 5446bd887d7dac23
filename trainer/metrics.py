"""What the user sees: summary lines on rank 0 (under a progress bar on a terminal), train.log,
metrics.jsonl, diagnostics.jsonl, wandb."""
from __future__ import annotations

import datetime
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from trainer.config import Config
from trainer.files.safe_io import append_text, file_for_library, write_file


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux: the process's resident peak, the closest CPU analogue.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def entropy(weights: list[float]) -> float:
    return -sum(w * math.log(w) for w in weights if w > 0)


def finite_or_null(value):
    """The value with every NaN and infinity replaced by None: JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def json_line(record: dict) -> str:
    return json.dumps(finite_or_null(record), allow_nan=False) + "\n"


def _parse(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def keep_rows_up_to(path: Path, last_step: int) -> list[str]:
    """Rewrite a JSON-lines file without the rows of steps after last_step (a resumed run logs them
    again) and without a truncated last line (a run killed mid-write); rows without a step stay.
    The rewrite goes to a temporary file that replaces the original, so a failure leaves it whole, in the
    file's own directory reached without following a link. Returns one line per thing dropped, for the log."""
    if not path.is_file():
        return []
    original = path.read_text()
    kept, later = [], 0
    for line in filter(str.strip, original.splitlines()):
        row = _parse(line)
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, (int, float)) and step > last_step:
            later += 1
        else:
            kept.append(line)
    dropped = []
    if later:
        rows = "1 row" if later == 1 else f"{later} rows"
        dropped.append(f"{path.name}: dropped {rows} after step {last_step} (this launch runs those steps again)")
    if kept and _parse(kept[-1]) is None:
        dropped.append(f"{path.name}: dropped a truncated last line (a run killed mid-write): {kept.pop()[:60]!r}")
    text = "".join(line + "\n" for line in kept)
    if text != original:
        write_file(path, text, root=path.parent)
    return dropped


def format_duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


class MetricsLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing. Every write reaches run_dir without
    following a link (safe_io), so a run directory replaced by one since the start stops the run in one line.

    Nothing in the run directory is created or changed until there is something to write, and a
    launch that will not train (start_step >= train.steps) writes nothing at all: its lines go to
    stderr only. The first row written in a launch first drops the rows a crashed launch logged
    after the checkpoint this one resumed from, so every step appears once."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, start_step: int):
        self.enabled = enabled
        self.wandb_run = None
        self.bar = None
        if not enabled:
            return
        self.total_steps = cfg.train.steps
        self.start_step = start_step
        self.writes_files = start_step < cfg.train.steps
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.diagnostics_path = run_dir / "diagnostics.jsonl"
        self.log_path = run_dir / "train.log"
        self.rows_trimmed = False
        self.launch_started = time.perf_counter()
        self.steps_this_launch = 0
        # Without a terminal (nohup, Slurm) a bar is only carriage returns in a file: the summary
        # lines, which carry step/total and the ETA, are the progress there.
        self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", unit="step",
                        dynamic_ncols=True, file=sys.stderr, disable=not sys.stderr.isatty())
        if cfg.logging.wandb.mode != "disabled" and self.writes_files:
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb
            from omegaconf import OmegaConf

            self.wandb_run = wandb.init(
                project=cfg.logging.wandb.project, name=cfg.logging.wandb.name or run_dir.name,
                mode=cfg.logging.wandb.mode, dir=str(run_dir), config=OmegaConf.to_container(OmegaConf.structured(cfg)),
                resume="allow", id=_wandb_id(run_dir))

    def print(self, line: str) -> None:
        """To stderr (above the bar on a terminal) and, with a timestamp, to train.log."""
        if not self.enabled:
            return
        if self.bar.disable:
            print(line, file=sys.stderr, flush=True)
        else:
            self.bar.write(line, file=sys.stderr)
        if self.writes_files:
            stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
            # Opened per line: a process killed with os._exit or SIGKILL loses no buffered line.
            append_text(self.log_path, f"{stamp} {line}\n", root=self.run_dir)

    def advance(self, loss: float, tokens_per_s: float) -> None:
        if self.enabled:
            self.steps_this_launch += 1
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)

    def eta_s(self, step: int) -> float | None:
        """Seconds left at the mean wall time per step of this launch (evaluation and checkpoints included)."""
        if not self.steps_this_launch:
            return None
        per_step = (time.perf_counter() - self.launch_started) / self.steps_this_launch
        return per_step * max(self.total_steps - step, 0)

    def summary(self, record: dict) -> None:
        if self.enabled:
            self.print(summary_line(record, self.total_steps, self.eta_s(record["step"])))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._append(self.metrics_path, record)
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def log_diagnostics(self, record: dict) -> None:
        if not self.enabled:
            return
        self._append(self.diagnostics_path, record)
        if self.wandb_run is not None:
            flat = {f"diag/output_rms/{k}": v for k, v in record["output_rms"].items()}
            flat.update({f"diag/grad_rms/{k}": v for k, v in record["grad_rms"].items()})
            flat.update({f"diag/depth_entropy/{k}": v for k, v in record.get("depth_entropy", {}).items()})
            self.wandb_run.log(flat, step=record["step"])

    def _append(self, path: Path, record: dict) -> None:
        if not self.writes_files:
            return
        if not self.rows_trimmed:
            self.rows_trimmed = True
            for dropped in [*keep_rows_up_to(self.metrics_path, self.start_step),
                            *keep_rows_up_to(self.diagnostics_path, self.start_step)]:
                self.print(dropped)
        append_text(path, json_line(record), root=self.run_dir)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _wandb_id(run_dir: Path) -> str:
    """A stable id per run directory, so a resumed run continues the same wandb run."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


def summary_line(record: dict, total_steps: int | None = None, eta_s: float | None = None) -> str:
    step = f"step {record['step']}" + (f"/{total_steps}" if total_steps is not None else "")
    parts = [step, f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f}")
    parts += [f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}",
              f"{record['tokens_per_s']:,.0f} tok/s", f"{record['step_time_s']:.2f} s/step",
              f"mem {record['peak_mem_mb']:,.0f} MB", f"moe imb {record['moe_load_imbalance']:.2f}"]
    if record.get("tflops") is not None:
        parts.append(f"{record['tflops']:.3g} TFLOP/s")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    if eta_s is not None:
        parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


class StepProfiler:
    """`debug.profile_steps=[a, b]`: a torch.profiler trace of training steps a..b (those of them this
    launch runs), each inside a `train_step <n>` range, written as a Chrome trace (JSON) to
    <run.dir>/profile/rank<r>_steps<first>-<last>.json by every rank. Evaluation and checkpoints
    between the steps are left out of the ranges but not out of the trace."""

    def __init__(self, steps: list[int] | None, directory: Path, rank: int, device: torch.device):
        self.first, self.last = steps if steps else (None, None)
        self.directory, self.rank = directory, rank
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = None
        self.step_range = None
        self.steps_covered: list[int] = []

    def _covers(self, step: int) -> bool:
        return self.first is not None and self.first <= step <= self.last

    def before_step(self, step: int) -> None:
        if not self._covers(step):
            return
        if self.profile is None:
            self.profile = torch.profiler.profile(activities=self.activities)
            self.profile.start()
        self.step_range = torch.profiler.record_function(f"train_step {step}")
        self.step_range.__enter__()
        self.steps_covered.append(step)

    def after_step(self, step: int) -> Path | None:
        """The trace's path once the range's last step is done, else None."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        return self.close() if step == self.last else None

    def close(self) -> Path | None:
        """Stop and write the trace (a temporary file renamed into place); None if nothing was profiled."""
        if self.profile is None:
            return None
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        profile, self.profile = self.profile, None  # a failed write is not tried again by the trainer's last close()
        profile.stop()
        path = self.directory / f"rank{self.rank}_steps{self.steps_covered[0]}-{self.steps_covered[-1]}.json"
        # The exporter opens a path with open(), which would follow a link: it gets a file made without
        # following one, profile/ reached from the run directory (its parent) likewise.
        with file_for_library(path, root=self.directory.parent) as target:
            profile.export_chrome_trace(str(target))
        return path
