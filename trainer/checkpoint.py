"""Checkpoints with torch.distributed.checkpoint (DCP): save, find, validate, load.

One checkpoint is <run_dir>/checkpoints/step_00000100/ holding
  .metadata, *.distcp    DCP shards of the model, the optimizers and the LR scheduler
  extra/rank_<r>.pt      per-rank trainer state (data position, RNG states, ...), torch.save'd
  meta.json              step, world_size, model_fingerprint, time
Everything is written under checkpoints/.tmp-step_00000100 and renamed into place by rank 0 once every
rank has finished, so a directory named step_* is always complete and a run killed mid-write keeps its
previous checkpoints. Works in a single process (no process group) and with one, e.g. DDP over gloo.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import warnings
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from model.config import ModelConfig

CHECKPOINTS_DIR = "checkpoints"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"step_(\d{8})")
META_FILE = "meta.json"
DCP_METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, unreadable or from another model; the message is one line."""


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:08d}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextmanager
def _single_process_is_fine():
    """DCP warns on every save/load without a process group; here that is a supported mode, not a slip."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _refuse_non_finite(model: nn.Module, step: int) -> None:
    """Raise on every rank if any rank holds a NaN/inf parameter (ranks may hold different parameters,
    e.g. pipeline stages, and must all stop together rather than leave some waiting in a collective)."""
    bad = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
    any_bad = bad is not None
    if _distributed():
        flag = torch.tensor([float(any_bad)], device=next(model.parameters()).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        any_bad = flag.item() > 0
    if any_bad:
        where = f"parameter {bad}" if bad else "a parameter on another rank"
        raise CheckpointError(f"refusing to save the checkpoint of step {step}: {where} is not finite; "
                              "the previous checkpoints are kept")


def _dcp_state(model: nn.Module, optimizers: list, scheduler, shards) -> dict:
    """What DCP saves/loads. get_state_dict names everything by canonical parameter names (no DDP
    `module.` prefix), so a checkpoint loads with or without DDP and at another world size; `shards`
    (parallel.tensor.Shards, or None) turns tp/ep slices into whole tensors."""
    if optimizers:
        model_state, optim_state = get_state_dict(model, optimizers)
        state = {"model": model_state, "optim": optim_state}
    else:
        state = {"model": get_model_state_dict(model)}
    if shards is not None:
        state = shards.to_checkpoint(state)
    if scheduler is not None:
        state["scheduler"] = scheduler  # Stateful: DCP calls its state_dict / load_state_dict
    return state


def _complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Complete checkpoints under checkpoints_dir, oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.iterdir()
             if STEP_DIR.fullmatch(p.name) and (p / META_FILE).is_file() and (p / DCP_METADATA).is_file()]
    return sorted(found, key=lambda p: p.name)


def _prune(checkpoints_dir: Path, keep_last: int) -> None:
    complete = _complete_checkpoints(checkpoints_dir)
    for old in complete[: max(0, len(complete) - keep_last)]:
        shutil.rmtree(old)
    # Leftovers of saves killed mid-write; the save in progress has already been renamed.
    for stale in checkpoints_dir.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale)


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizers: list, scheduler,
                    extra: dict, meta: dict, keep_last: int, shards=None) -> Path:
    """Every rank calls this. `extra` is this rank's own state; `meta` (from rank 0) should carry
    model_fingerprint; step, world_size and time are added. Returns the checkpoint directory."""
    _refuse_non_finite(model, step)
    rank = dist.get_rank() if _distributed() else 0
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(TMP_PREFIX + final.name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier save of this step killed mid-write
        (tmp / "extra").mkdir(parents=True)
    _barrier()
    with _single_process_is_fine():
        dcp.save(_dcp_state(model, optimizers, scheduler, shards), checkpoint_id=tmp)
    torch.save(extra, tmp / "extra" / f"rank_{rank}.pt")
    _barrier()
    if rank == 0:
        meta = {**meta, "step": step, "world_size": dist.get_world_size() if _distributed() else 1,
                "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():
            # Re-saving a step (a run resumed from an older checkpoint): move the old one aside to be
            # pruned, so a kill between the two renames still leaves a complete checkpoint of this step.
            final.rename(final.with_name(f"{TMP_PREFIX}replaced-{final.name}"))
        tmp.rename(final)
        _prune(final.parent, keep_last)
    _barrier()
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (has meta.json and DCP .metadata), or None."""
    complete = _complete_checkpoints(Path(run_dir) / CHECKPOINTS_DIR)
    return complete[-1] if complete else None


def resolve_checkpoint(path_or_run_dir: str | Path) -> Path:
    """A checkpoint directory is itself; a run directory is its newest complete checkpoint."""
    path = Path(path_or_run_dir)
    if STEP_DIR.fullmatch(path.name) or (path / META_FILE).is_file():
        return path
    if (path / CHECKPOINTS_DIR).is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"run directory {path} has no complete checkpoint in {path / CHECKPOINTS_DIR}")
        return latest
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    raise CheckpointError(f"{path} is neither a checkpoint directory (step_XXXXXXXX with {META_FILE}) "
                          f"nor a run directory with a {CHECKPOINTS_DIR}/ folder")


def read_meta(path: str | Path) -> dict:
    """meta.json of a checkpoint, after checking every part of it is present."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    missing = [name for name in (META_FILE, DCP_METADATA, "extra/rank_0.pt") if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    try:
        return json.loads((path / META_FILE).read_text())
    except ValueError as error:
        raise CheckpointError(f"checkpoint {path} has an unreadable {META_FILE}: {error}") from None


def _one_line(error: BaseException) -> str:
    # DCP gathers per-rank failures, as (exception, traceback) pairs, into a CheckpointException whose
    # text is whole tracebacks; name the first failure instead.
    prefix = ""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (error, _) = next(iter(error.failures.items()))
        prefix = f"rank {rank}: "
    lines = str(error).splitlines()
    return f"{prefix}{type(error).__name__}" + (f": {lines[0]}" if lines else "")


def load_checkpoint(path: str | Path, model: nn.Module, optimizers: list, scheduler, rank: int,
                    fingerprint: str | None = None, shards=None) -> tuple[dict, dict]:
    """Load model, optimizers and scheduler in place; return (this rank's extra, meta).

    Pass optimizers=[] and scheduler=None to load the model only. With `fingerprint`, a checkpoint of
    another model is refused (check_compatible) before any weight is touched. A rank without its own
    extra file (the world size changed) gets rank 0's; meta["world_size"] tells the caller.
    """
    path = Path(path)
    meta = read_meta(path)
    if fingerprint is not None:
        check_compatible(meta, fingerprint, path)
    extra_file = path / "extra" / f"rank_{rank}.pt"
    if not extra_file.is_file():
        extra_file = path / "extra" / "rank_0.pt"
    state = _dcp_state(model, optimizers, scheduler, shards)
    try:
        with _single_process_is_fine():
            dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} could not be read ({_one_line(error)})") from error
    if shards is not None:
        state = shards.from_checkpoint(state)
    if optimizers:
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    try:
        # Our own file of RNG states and plain Python values, which the weights-only unpickler refuses.
        extra = torch.load(extra_file, weights_only=False)
    except Exception as error:
        raise CheckpointError(f"checkpoint {path}: {extra_file.name} could not be read ({_one_line(error)})") from error
    return extra, meta


def _flatten(values: dict, prefix: str) -> dict[str, object]:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# Fields a resumed run may change: they neither shape the weights nor change what the model computes
# beyond training dynamics (two_phase is an exact rewrite of the per-layer read; kernel_impl picks
# kernels that compute the same thing).
RESUMABLE_CHANGES = ("model.init", "model.init_std", "model.kernel_impl", "model.kda.chunk_size", "model.moe.bias_update_rate",
                     "model.moe.aux_loss_coef", "model.residual.two_phase")


def model_fingerprint(model_cfg: ModelConfig) -> str:
    """The ModelConfig fields that define the model, as `key=value`, space-separated, named as the
    override that sets it (`model.d_model=256 ... variant.variant=block`), so a mismatch says what to change."""
    flat = _flatten(dataclasses.asdict(model_cfg), "model.")
    flat = {key: value for key, value in flat.items() if key not in RESUMABLE_CHANGES}
    # Residual options are set through the `variant` config group.
    return " ".join(f"{key.replace('model.residual.', 'variant.', 1)}={value}" for key, value in flat.items())


def _parse_fingerprint(fingerprint: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in fingerprint.split())


def check_compatible(meta: dict, fingerprint: str, path: str | Path = "") -> None:
    """Raise CheckpointError naming only the differing keys when the checkpoint's model is not this run's."""
    written = meta.get("model_fingerprint")
    if written == fingerprint:
        return
    name = f"checkpoint {path}".rstrip()
    if written is None:
        raise CheckpointError(f"{name} has no model_fingerprint in its {META_FILE}; cannot tell which model wrote it")
    theirs, ours = _parse_fingerprint(written), _parse_fingerprint(fingerprint)
    # A checkpoint written before an option existed (e.g. variant.streams) was built with its default.
    defaults = _parse_fingerprint(model_fingerprint(ModelConfig()))
    theirs = {**{key: defaults[key] for key in ours if key not in theirs and key in defaults}, **theirs}
    differing = [key for key in dict.fromkeys([*theirs, *ours]) if theirs.get(key) != ours.get(key)]
    if not differing:
        return

    def show(values: dict[str, str]) -> str:
        return " ".join(f"{key}={values.get(key, '<absent>')}" for key in differing)

    raise CheckpointError(f"{name} was written by {show(theirs)}; this run has {show(ours)}")
