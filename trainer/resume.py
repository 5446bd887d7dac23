"""Starting a launch in its run directory: what the directory may hold before anything is built
(check_start), the checkpoint the launch goes on from (resume=auto: the newest that verifies, saying which
newer ones it skipped; a path: that one, verified), the trainer state restored from it with every field
checked (restore_extra), and the learning-rate schedule continued without a jump (continue_schedule)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path

from torch.optim.lr_scheduler import LRScheduler

from model import build_model
from model.params import count_parameters
from parallel.dims import barrier
from trainer import retrofit
from trainer.config import Config, ConfigError, TrainConfig
from trainer.data import SampleSampler
from trainer.optim import lr_multiplier, schedules_agree, set_schedule_step, wsd_decay_start
from trainer.rng_state import set_rng_state
from trainer.run_dir.checkpoint import (CHECKPOINTS_DIR, META_FILE, CheckpointError, checkpoint_path, latest_checkpoint,
                                        load_checkpoint, newest_verified_checkpoint, pinned_names, read_meta,
                                        remove_partial_saves, resolve_checkpoint, unfinished_checkpoints)
from trainer.run_dir.finished import FINISHED_FILE, finished_step
from trainer.run_dir.lock import check_room

SCHEDULE_KEYS = ("steps", "schedule", "warmup_steps", "decay_fraction", "min_lr_ratio")


@dataclass
class Resumed:
    """What a launch took over from the checkpoint it resumed."""
    path: Path
    step: int
    skipped_steps: int
    train: TrainConfig | None  # the train config the checkpoint was written with (None: one without it)


def check_start(cfg: Config, run_dir: Path, is_main: bool) -> None:
    """Every rank reads the run directory's state the same way, so a refusal here stops them all."""
    existing = latest_checkpoint(run_dir)
    if cfg.resume == "never" and existing is not None:
        raise ConfigError(f"resume=never but run.dir={run_dir} already holds {existing.name}; "
                          "use resume=auto to continue it or pick another run.dir")
    finished = finished_step(run_dir)
    if finished and existing is None and cfg.resume in ("auto", "never"):
        raise ConfigError(f"run.dir={run_dir} finished at step {finished} ({FINISHED_FILE}) and holds no "
                          "checkpoint: training it again would start at step 0 and replace its metrics; "
                          "pick another run.dir")
    pinned_names(run_dir / CHECKPOINTS_DIR)
    if is_main:
        # A save killed by a full disk leaves its partial directory, holding the room the next save needs.
        for partial in remove_partial_saves(run_dir):
            print(f"run.dir={run_dir}: removed {partial.name}, a checkpoint save that did not finish",
                  file=sys.stderr)
        for unfinished in unfinished_checkpoints(run_dir):
            print(f"run.dir={run_dir}: {unfinished.name} has no {META_FILE} (deleted after it was "
                  "written?) and is not resumed from", file=sys.stderr)
    barrier()
    check_room(run_dir, count_parameters(build_model(cfg, device="meta"))["total"])


def resume(cfg: Config, run_dir: Path, is_main: bool, rank: int, model, optimizer, scheduler: LRScheduler,
           sampler: SampleSampler, fingerprint: str, mesh) -> Resumed | None:
    """Load the checkpoint cfg.resume picks into the model, optimizer, scheduler, sampler and RNGs; None: a
    fresh start."""
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        path = _newest_verified_checkpoint(run_dir, is_main)
        if path is None:
            return None
    else:
        path = resolve_checkpoint(cfg.resume)  # the user named it: a corrupt one is an error, not skipped
    # Optimizer state exists for what the checkpoint's last step trained: load into that set.
    retrofit.set_trainable(model, cfg.train, max(0, read_meta(path)["step"] - 1))
    extra, meta = load_checkpoint(path, model, optimizer.optimizers, scheduler, rank, fingerprint=fingerprint,
                                  mesh=mesh, verify=cfg.resume != "auto")
    skipped = restore_extra(path, extra, meta["step"], rank, sampler)
    saved = meta.get("config", {}).get("train")
    train = None if saved is None else TrainConfig(**{f.name: saved[f.name] for f in fields(TrainConfig)
                                                      if f.name in saved})
    return Resumed(path, meta["step"], skipped, train)


def restore_extra(path: Path, extra: dict, step: int, rank: int, sampler: SampleSampler) -> int:
    """This rank's sampler and RNG states from the checkpoint's extra file, each field checked before it is
    used (a step that is not the checkpoint's would train at the wrong learning rate and misname
    checkpoints); returns its skipped_steps."""
    name = f"checkpoint {path}: extra/rank_{rank}.json"
    if not isinstance(extra, dict) or extra.get("step") != step or isinstance(extra.get("step"), bool):
        found = extra.get("step") if isinstance(extra, dict) else extra
        raise CheckpointError(f"{name} has step {found!r}; the checkpoint is of step {step}")
    skipped, sampler_state = extra.get("skipped_steps", 0), extra.get("sampler")
    if not isinstance(skipped, int) or isinstance(skipped, bool) or not 0 <= skipped <= step:
        raise CheckpointError(f"{name} has skipped_steps {skipped!r}; expected an integer in [0, {step}]")
    counters = ("consumed_samples", "seed", "seq_len", "pass_samples")
    if not isinstance(sampler_state, dict) or not all(type(sampler_state.get(key)) is int and sampler_state[key] >= 0
                                                      for key in counters):
        raise CheckpointError(f"{name} has no usable sampler state; expected integers >= 0 for "
                              f"{', '.join(counters)}")
    sampler.load_state_dict(sampler_state)
    try:
        set_rng_state(extra.get("rng"))
    except Exception as error:  # torch, numpy and random each reject a bad state with their own error types
        raise CheckpointError(f"{name} has an unusable rng state ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''})") from None
    return skipped


def _newest_verified_checkpoint(run_dir: Path, is_main: bool) -> Path | None:
    """resume=auto: the newest checkpoint that verifies, saying which newer ones were skipped and why."""
    path, skipped = newest_verified_checkpoint(run_dir)
    if is_main:
        for _, why in skipped:
            print(f"resume=auto: skipping {why}", file=sys.stderr)
    if path is None and skipped:
        # Starting over would overwrite them step by step; let the user decide.
        raise CheckpointError(f"resume=auto: none of the {len(skipped)} checkpoints in {run_dir / 'checkpoints'} "
                              "verifies (see above); move them away to start the run over")
    return path


def continue_schedule(resumed: Resumed, train: TrainConfig, scheduler: LRScheduler,
                      configured_lrs: list[float]) -> None:
    """Go on with this launch's LR schedule from the resumed step, refusing an LR jump.

    The rule: the schedule may change on resume only where it agrees with the checkpoint's own schedule
    on the last step the checkpoint took. Otherwise the LR would jump, e.g. train.steps raised on a
    finished or decaying wsd run takes the LR from its decayed value back to the peak. Such a run is
    extended from its pre-decay checkpoint (saved and kept for every wsd run), where both schedules are
    still at the peak. A new peak (optim.lr, optim.muon_lr) would jump too, and would otherwise be
    ignored silently (the checkpoint restores its own). train.allow_lr_change=true accepts a jump.
    """
    old, step = resumed.train, resumed.step
    if not train.allow_lr_change:
        if old is not None and step > 0 and not schedules_agree(step - 1, old, train):
            raise ConfigError(_lr_jump_message(resumed, train, scheduler.base_lrs[0]))
        if scheduler.base_lrs != configured_lrs:
            raise ConfigError(_peak_change_message(resumed, configured_lrs, scheduler.base_lrs))
    set_schedule_step(scheduler, step, base_lrs=configured_lrs)


def _peak_change_message(resumed: Resumed, configured_lrs: list[float], checkpoint_lrs: list[float]) -> str:
    def peaks(lrs: list[float]) -> str:
        return "/".join(f"{lr:.3g}" for lr in dict.fromkeys(lrs))

    return (f"resuming {resumed.path} with peak lr {peaks(configured_lrs)} (optim.lr, optim.muon_lr) but it "
            f"was trained at {peaks(checkpoint_lrs)}; drop the override, or set "
            "train.allow_lr_change=true to train on at the new peak")


def _lr_jump_message(resumed: Resumed, new: TrainConfig, base_lr: float) -> str:
    old, step = resumed.train, resumed.step
    changed = ", ".join(f"train.{key}={getattr(new, key)} (checkpoint: {getattr(old, key)})"
                        for key in SCHEDULE_KEYS if getattr(old, key) != getattr(new, key))
    pre_decay = pre_decay_checkpoint(resumed, old, new)
    fix = (f"to extend a wsd run, resume from its pre-decay checkpoint: resume={pre_decay} run.dir=<a new dir>"
           if pre_decay else "start a new run.dir instead")
    return (f"resuming {resumed.path} with {changed or 'this schedule'} would move the lr from "
            f"{base_lr * lr_multiplier(step - 1, old):.3g} at step {step} to "
            f"{base_lr * lr_multiplier(step, new):.3g} at step {step + 1}; {fix}, or set "
            "train.allow_lr_change=true to accept the jump")


def pre_decay_checkpoint(resumed: Resumed, old: TrainConfig, new: TrainConfig) -> Path | None:
    """The resumed run's checkpoint from just before its wsd decay (old: its train config), if it holds one
    the schedule `new` can continue from without an LR jump."""
    start = wsd_decay_start(old)
    path = checkpoint_path(resumed.path.parent.parent, start)
    usable = (old.schedule == "wsd" and 0 < start < resumed.step and (path / META_FILE).is_file()
              and schedules_agree(start - 1, old, new))
    return path if usable else None


def complete_message(resumed: Resumed, train: TrainConfig, run_dir: Path) -> str:
    """What a launch of a run already at train.steps says: nothing changed, and how to train longer."""
    pre_decay = pre_decay_checkpoint(resumed, resumed.train or train, train)
    more = (f"to train longer, extend it from its pre-decay checkpoint: resume={pre_decay} "
            f"train.steps=<more> run.dir=<a new dir>" if pre_decay else "to train longer, start a new run.dir")
    return (f"run already complete at step {resumed.step}/{train.steps}, nothing changed in {run_dir}; "
            f"{more} (a larger train.steps here would raise the decayed lr again)")
