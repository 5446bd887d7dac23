"""Checkpoints with torch.distributed.checkpoint (DCP): save, find, verify, load.

One checkpoint is <run_dir>/checkpoints/step_00000100/ holding
  .metadata, *.distcp    DCP shards of the model, the optimizers and the LR scheduler
  extra/rank_<r>.json    per-rank trainer state (data position, RNG states, ...) as JSON values
  meta.json              step, world_size, model_fingerprint, config, tokenizer_sha256 (of the run's
                         tokenizer.json, or null), format, `files`: the size and sha256 of every other
                         file of the checkpoint, by path relative to it, and meta_sha256: the sha256 of
                         meta.json's own content (format 3)
Everything is written under checkpoints/.tmp-step_00000100 and renamed into place by rank 0 once every
rank has finished; meta.json is written last, so a step_* directory with a meta.json is complete, and a
run killed mid-write keeps its previous checkpoints. Every write, rename and removal reaches checkpoints/
without following a link (safe_io.open_dir, PendingSave), so one planted there or at .tmp-step_N during a
run stops the save in one line instead of writing into, or pruning, its target. Works in a single process
(no process group) and with one, e.g. DDP over gloo; under torchrun the ranks split the hashing (rank r
hashes every r-th file).

Nothing is unpickled from a run: extra files are JSON, DCP's `.metadata` is unpickled with an allowlist
of DCP's own metadata classes and its non-tensor entries with torch.load(weights_only=True)
(trainer/run_dir/safe_dcp.py). Before loading touches any weight, every file listed in meta.json is checked for
its size and sha256 (the ranks split this too and agree before any of them goes on), which catches
truncated, zeroed, overwritten or missing files. sha256 because it is the standard (`sha256sum` checks a
file by hand) and hashes at disk speed; a checksum detects damage, it does not authenticate: whoever can
rewrite the files can rewrite meta.json, hence the unpickling restrictions, and hence every field of
meta.json is checked (meta_problem: types, ranges, its config against the trainer's own checks) and a
model is built from its config only after the shapes it gives match the weights (check_model_shapes).
meta_sha256 makes damage to meta.json corruption like damage to any other file; format 2 checkpoints
(the same, without it) are still read. Checkpoints of the earliest format (pickled extra/rank_<r>.pt, no
checksums) are refused, since reading them means unpickling.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import warnings
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from model import build_model
from model.config import ModelConfig
from model.params import config_counts
from parallel.failure import one_line
from parallel.state_dict import from_global_state, to_global_state
from trainer.config import RENAMED_KEYS, ConfigError, config_from_saved
from trainer.run_dir.safe_dcp import SafeFileSystemReader, WeightsOnlyLoadPlanner
from trainer.files.safe_io import (LinkedPathError, check_still, held_dir, held_path, open_dir, remove_entry,
                                     write_file)

CHECKPOINTS_DIR = "checkpoints"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"step_(\d{8})")
META_FILE = "meta.json"
DCP_METADATA = ".metadata"
EXTRA_DIR = "extra"
FORMAT = 3  # 3: meta.json carries meta_sha256; 2: no checksum over meta.json; 1 (unnumbered): pickled extra, no checksums
READABLE_FORMATS = (2, 3)
META_DIGEST = "meta_sha256"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
NESTED_PARAM_GROUP = re.compile(r"optim\.param_groups\.\d+\.params")
PARAM_GROUPS = "param_groups."  # the flattened optimizer state's settings entries (dcp_state)


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt, unreadable or from another model; the message is one line."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint of the earlier, pickled format; resume=auto stops at it rather than skip past it."""


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:08d}"


def _extra_file(rank: int) -> str:
    return f"{EXTRA_DIR}/rank_{rank}.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _gather(value) -> list:
    """Every rank's `value` (JSON-like), in rank order, on every rank."""
    if not _distributed():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@contextmanager
def _single_process_is_fine():
    """DCP warns on every save/load without a process group; here that is a supported mode, not a slip."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _refuse_non_finite(model: nn.Module, step: int) -> None:
    """Raise on every rank if any rank holds a NaN/inf parameter (ranks may hold different parameters,
    e.g. pipeline stages, and must all stop together rather than leave some waiting in a collective)."""
    # This rank's shard of an FSDP parameter: the whole DTensor would all-reduce once per parameter.
    local = ((name, p.to_local() if isinstance(p, DTensor) else p) for name, p in model.named_parameters())
    bad = next((name for name, p in local if not torch.isfinite(p).all()), None)
    any_bad = bad is not None
    if _distributed():
        flag = torch.tensor([float(any_bad)], device=next(model.parameters()).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        any_bad = flag.item() > 0
    if any_bad:
        where = f"parameter {bad}" if bad else "a parameter on another rank"
        raise CheckpointError(f"refusing to save the checkpoint of step {step}: {where} is not finite; "
                              "the previous checkpoints are kept")


def _optim_options(flat: bool) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=flat)


def dcp_state(model: nn.Module, optimizers: list, scheduler, mesh, flat_optim: bool = True) -> dict:
    """What DCP saves/loads. get_state_dict names everything by canonical parameter names (no DDP
    `module.` prefix), so a checkpoint loads with or without DDP and at another world size; over `mesh`
    (the layout's DeviceMesh, None for one process) tp/ep slices are shown as whole tensors
    (parallel.state_dict).

    The optimizer state is flattened by parameter name (`state.<name>.exp_avg`): nested, its param groups
    are keyed by their index, and pipeline stages, whose groups hold different parameters under the same
    index, overwrote each other's `param_groups.0.params` in the one checkpoint. The param groups' settings
    are not saved: each is the config's, or, for lr and initial_lr, the schedule's, which the scheduler's own
    state restores (_restore_scheduled_lrs); flattened, they were one entry per parameter and setting, most
    of a small model's checkpoint entries and half its save time (docs/BENCHMARKS.md). flat_optim=False
    reads checkpoints written before (nested_optimizer_layout), param groups and all."""
    if optimizers:
        model_state, optim_state = get_state_dict(model, optimizers, options=_optim_options(flat_optim))
        if flat_optim:
            optim_state = {key: value for key, value in optim_state.items() if not key.startswith(PARAM_GROUPS)}
        state = {"model": model_state, "optim": optim_state}
    else:
        state = {"model": get_model_state_dict(model)}
    if mesh is not None:
        state = to_global_state(state, model, mesh)
    if scheduler is not None:
        state["scheduler"] = scheduler  # Stateful: DCP calls its state_dict / load_state_dict
    return state


def _restore_scheduled_lrs(scheduler) -> None:
    """Each param group's lr and initial_lr as the restored schedule set them: the settings a checkpoint
    leaves out (dcp_state) that training changes."""
    for group, lr, base_lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), scheduler.base_lrs,
                                  strict=True):
        group["lr"], group["initial_lr"] = lr, base_lr


def _current_param_groups(model: nn.Module, optimizers: list) -> dict:
    """This rank's param-group settings, flattened by parameter name as set_state_dict reads them."""
    _, optim_state = get_state_dict(model, optimizers, options=_optim_options(True))
    return {key: value for key, value in optim_state.items() if key.startswith(PARAM_GROUPS)}


# -- checksums -------------------------------------------------------------------------------------

def _file_record(file: Path) -> dict:
    with file.open("rb") as stream:
        return {"bytes": file.stat().st_size, "sha256": hashlib.file_digest(stream, "sha256").hexdigest()}


def hash_share(checkpoint: Path, rank: int, world: int) -> dict[str, dict]:
    """Size and sha256 of this rank's share of a written checkpoint's files (every world-th of them, meta.json
    left out); needs no process group, so an asynchronous save's background thread can run it."""
    names = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    names = [name for name in names if name != META_FILE]
    return {name: _file_record(checkpoint / name) for name in names[rank::world]}


def merge_shares(mine: dict[str, dict]) -> dict[str, dict]:
    """Every rank's hash_share as one table, on every rank (collective under torchrun)."""
    return {name: record for part in _gather(mine) for name, record in part.items()}


def _files_problem(checkpoint: Path, files: dict[str, dict]) -> str | None:
    """Why a file of `files` (name -> meta.json's record) is not as recorded, or None. Sizes first: a
    missing or truncated file is found without hashing the others."""
    for name, recorded in files.items():
        file = checkpoint / name
        if not file.is_file():
            return f"is incomplete: missing {name}"
        size = file.stat().st_size
        if size != recorded["bytes"]:
            return (f"is corrupt: {name} is {size} bytes, {META_FILE} records {recorded['bytes']} "
                    "(truncated or overwritten)")
    for name, recorded in files.items():
        if _file_record(checkpoint / name)["sha256"] != recorded["sha256"]:
            return (f"is corrupt: {name} does not match its sha256 in {META_FILE} "
                    "(its bytes changed after it was written)")
    return None


# -- finding checkpoints ---------------------------------------------------------------------------

def _complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Checkpoints under checkpoints_dir whose meta.json was written (the last file of a save), oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.iterdir()
             if STEP_DIR.fullmatch(p.name) and not p.is_symlink() and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def unfinished_checkpoints(run_dir: str | Path) -> list[Path]:
    """step_* directories without a meta.json: a save writes meta.json last and renames a finished
    checkpoint into place, so one of these lost its meta.json afterwards; resume never picks them."""
    checkpoints_dir = Path(run_dir) / CHECKPOINTS_DIR
    if not checkpoints_dir.is_dir():
        return []
    return sorted(p for p in checkpoints_dir.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()
                  and not (p / META_FILE).is_file())


def _remove_partial(checkpoints_dir: Path) -> list[Path]:
    partial = sorted(checkpoints_dir.glob(TMP_PREFIX + "*"))
    for entry in partial:
        remove_entry(entry)
    return partial


def remove_partial_saves(run_dir: str | Path) -> list[Path]:
    """Delete the .tmp-* directories of saves that did not finish (a kill, a full disk) and return them:
    one left behind holds space the next save needs. Call only while no save runs (at start, rank 0)."""
    checkpoints_dir = Path(run_dir) / CHECKPOINTS_DIR
    if not os.path.lexists(checkpoints_dir):
        return []
    with held_dir(run_dir, CHECKPOINTS_DIR) as held:
        return [checkpoints_dir / entry.name for entry in _remove_partial(held)]


PINNED_FILE = "pinned.json"  # a JSON list of checkpoint names _prune never removes


def pin_checkpoint(run_dir: str | Path, step: int) -> None:
    """Keep the checkpoint of `step` past keep_last, whether or not it is written yet (the trainer pins a
    wsd run's pre-decay checkpoint, the one such a run can be extended from)."""
    pinned_file = Path(run_dir) / CHECKPOINTS_DIR / PINNED_FILE
    names = pinned_names(pinned_file.parent) | {checkpoint_path(run_dir, step).name}
    write_file(pinned_file, json.dumps(sorted(names)) + "\n", root=run_dir)


def pinned_names(checkpoints_dir: Path) -> set[str]:
    """The checkpoint names pinned.json lists; CheckpointError in one line if it is not a list of them."""
    pinned_file = checkpoints_dir / PINNED_FILE
    if not pinned_file.is_file():
        return set()
    try:
        names = json.loads(pinned_file.read_text())
    except (ValueError, OSError) as error:
        raise CheckpointError(f"{pinned_file} could not be read ({str(error).splitlines()[0]})") from None
    if not isinstance(names, list) or not all(isinstance(name, str) and STEP_DIR.fullmatch(name) for name in names):
        raise CheckpointError(f"{pinned_file} is not a JSON list of checkpoint names (step_XXXXXXXX); fix or "
                              "delete it (it only keeps the checkpoints it names from pruning)")
    return set(names)


def _prune(checkpoints_dir: Path, keep_last: int, saved: Path) -> None:
    """Keep the `keep_last` newest checkpoints up to the one just saved. Checkpoints of later steps exist
    only when this run resumed from an older one (e.g. past a corrupt newest checkpoint): they are neither
    counted nor allowed to push out the one just saved (saving their step again replaces them).
    checkpoints_dir is a safe_io.held_dir, so what is removed is an entry of the run's own checkpoints/."""
    pinned = pinned_names(checkpoints_dir)
    kept = [p for p in _complete_checkpoints(checkpoints_dir) if p.name <= saved.name and p.name not in pinned]
    for old in kept[: max(0, len(kept) - keep_last)]:
        remove_entry(old)
    _remove_partial(checkpoints_dir)  # the save in progress has already been renamed


@contextmanager
def _unsaved_if_linked(step: int):
    """A link planted in run.dir during a save (safe_io.LinkedPathError) stops it in one line."""
    try:
        yield
    except LinkedPathError as error:
        raise CheckpointError(f"the checkpoint of step {step} was not saved and no checkpoint was removed: "
                              f"{error}") from None


@dataclasses.dataclass
class PendingSave:
    """A save between begin_save and publish. `handle` holds its .tmp-step_N open, reached without following
    a link: DCP writes and the hashing reads go through `target`, its held_path, so a link planted on the way
    to .tmp-step_N meanwhile sends nothing elsewhere, and publish renames only the directory held."""
    final: Path
    tmp: Path
    handle: int

    @property
    def target(self) -> Path:
        return held_path(self.handle)

    def close(self) -> None:
        os.close(self.handle)


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizers: list, scheduler,
                    extra: dict, meta: dict, keep_last: int, mesh=None) -> Path:
    """Every rank calls this. `extra` is this rank's own state, made of JSON values (dict, list, str,
    int, float, bool, None; tuples come back as lists); `meta` (from rank 0) should carry
    model_fingerprint; step, world_size, time, format and files are added. Returns the checkpoint directory.
    trainer/run_dir/async_checkpoint.py runs the same three parts with the write in the background."""
    pending = begin_save(run_dir, step, model, extra)
    try:
        with _single_process_is_fine():
            dcp.save(dcp_state(model, optimizers, scheduler, mesh), checkpoint_id=pending.target,
                     storage_writer=FileSystemWriter(pending.target))
        _barrier()
        publish(pending, meta, keep_last, merge_shares(hash_share(pending.target, *_rank_and_world())))
    finally:
        pending.close()
    return pending.final


def begin_save(run_dir: str | Path, step: int, model: nn.Module, extra: dict) -> PendingSave:
    """The first part of every save (collective): refuse non-finite weights, make the empty
    .tmp-step_N directory, hold it open on every rank and write this rank's extra file into it."""
    _refuse_non_finite(model, step)
    rank, _ = _rank_and_world()
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(TMP_PREFIX + final.name)
    with _unsaved_if_linked(step):
        if rank == 0:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            with held_dir(run_dir, CHECKPOINTS_DIR, create=True) as checkpoints:
                if os.path.lexists(checkpoints / tmp.name):
                    remove_entry(checkpoints / tmp.name)  # an earlier save of this step killed mid-write
            os.close(open_dir(run_dir, Path(CHECKPOINTS_DIR, tmp.name, EXTRA_DIR), create=True))
        _barrier()
        pending = PendingSave(final, tmp, open_dir(run_dir, Path(CHECKPOINTS_DIR, tmp.name)))
        try:
            write_file(tmp / _extra_file(rank), json.dumps(extra), root=run_dir)
        except BaseException:
            pending.close()
            raise
    return pending


def publish(pending: PendingSave, meta: dict, keep_last: int, files: dict[str, dict]) -> None:
    """The last part of every save, once every rank's DCP write has finished (collective): rank 0 writes
    meta.json with the files' checksums, renames the checkpoint into place and prunes. Until then resume
    never takes it: a step_* directory with a meta.json is complete."""
    rank, world = _rank_and_world()
    if rank == 0:
        final, tmp = pending.final, pending.tmp
        step = int(STEP_DIR.fullmatch(final.name).group(1))
        meta = seal_meta({**meta, "step": step, "world_size": world, "format": FORMAT, "files": files,
                          "time": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        with _unsaved_if_linked(step), held_dir(final.parent.parent, CHECKPOINTS_DIR) as checkpoints:
            check_still(pending.target, checkpoints / tmp.name, tmp)
            write_file(pending.target / META_FILE, json.dumps(meta, indent=2) + "\n")
            if os.path.lexists(checkpoints / final.name):
                # Re-saving a step (a run resumed from an older checkpoint): move the old one aside to be
                # pruned, so a kill between the two renames still leaves a complete checkpoint of this step.
                (checkpoints / final.name).rename(checkpoints / f"{TMP_PREFIX}replaced-{final.name}")
            (checkpoints / tmp.name).rename(checkpoints / final.name)
            _prune(checkpoints, keep_last, final)
    _barrier()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (it has its meta.json; not verified), or None."""
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
    """meta.json of a checkpoint, after checking it is of this format and every file it lists is present
    (their checksums are verify_checkpoint's job)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not (path / META_FILE).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {META_FILE}")
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (ValueError, RecursionError) as error:  # bad JSON, or nested deeper than the parser goes
        raise CheckpointError(f"checkpoint {path} has an unreadable {META_FILE}: {error}") from None
    if not isinstance(meta, dict) or "format" not in meta and "files" not in meta:
        raise CheckpointFormatError(
            f"checkpoint {path} is not in checkpoint format {FORMAT}: the earlier format (pickled "
            f"{EXTRA_DIR}/rank_N.pt, no checksums) is no longer loaded, since reading it means unpickling; "
            "start a new run.dir")
    problem = meta_problem(meta)
    named = STEP_DIR.fullmatch(path.name)
    if problem is None and named and int(named.group(1)) != meta["step"]:
        problem = f"records step {meta['step']}, not the {int(named.group(1))} its directory is named for"
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is corrupt: its {META_FILE} {problem}")
    # A checkpoint always has these two, so they must be listed too.
    required = dict.fromkeys([DCP_METADATA, _extra_file(0), *meta["files"]])
    missing = [name for name in required if name not in meta["files"] or not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    return meta


def meta_digest(meta: dict) -> str:
    """sha256 of meta.json's content but its own digest, over a canonical dump (sorted keys)."""
    content = {key: value for key, value in meta.items() if key != META_DIGEST}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def seal_meta(meta: dict) -> dict:
    """meta with its meta_sha256, so damage to meta.json itself counts as corruption (skip and fall back)."""
    return {**meta, META_DIGEST: meta_digest(meta)}


def _is_count(value: object, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _safe_relative(name: object) -> bool:
    return (isinstance(name, str) and bool(name) and not name.startswith("/") and "\x00" not in name
            and all(part not in ("", ".", "..") for part in name.split("/")))


def meta_problem(meta: dict) -> str | None:
    """What is wrong with a parsed meta.json (its checksum, a field's type or range, its config), or None.
    Every field the trainer and the tools read is checked here, before anything is sized by it."""
    if meta.get("format") not in READABLE_FORMATS:
        return f"has format {meta.get('format')!r}; this trainer reads formats {' and '.join(map(str, READABLE_FORMATS))}"
    if meta["format"] >= 3 and meta.get(META_DIGEST) != meta_digest(meta):
        return f"does not match its own {META_DIGEST} (its content changed after it was written)"
    if not _is_count(meta.get("step")):
        return f"has step {meta.get('step')!r}; expected an integer >= 0"
    if not _is_count(meta.get("world_size"), least=1):
        return f"has world_size {meta.get('world_size')!r}; expected an integer >= 1"
    if not isinstance(meta.get("model_fingerprint", ""), str):
        return "has a model_fingerprint that is not a string"
    tokenizer = meta.get("tokenizer_sha256")  # inference.export compares the run's tokenizer.json with it
    if tokenizer is not None and not (isinstance(tokenizer, str) and SHA256_HEX.fullmatch(tokenizer)):
        return f"has tokenizer_sha256 {tokenizer!r}; expected 64 hex digits or null"
    files = meta.get("files")
    if not isinstance(files, dict):
        return "has no `files` table of sizes and checksums"
    for name, record in files.items():
        if not _safe_relative(name):
            return f"lists {name!r} among its files; expected a path inside the checkpoint"
        if (not isinstance(record, dict) or not _is_count(record.get("bytes"))
                or not isinstance(record.get("sha256"), str) or not SHA256_HEX.fullmatch(record["sha256"])):
            return f"has a malformed record for {name}; expected {{\"bytes\": int, \"sha256\": 64 hex digits}}"
    if "config" in meta:
        try:
            config_from_saved(meta["config"])
        except ConfigError as error:
            return f"holds a config this trainer refuses ({error})"
    return None


def verify_checkpoint(path: str | Path) -> dict:
    """meta.json of a checkpoint after checking every file it lists against its size and sha256; raise a
    one-line CheckpointError naming the first bad file otherwise. Collective under torchrun: the ranks
    split the files and every rank raises (or returns) together."""
    path = Path(path)
    rank, world = _rank_and_world()
    meta, problem = None, None
    try:
        meta = read_meta(path)
        share = {name: meta["files"][name] for name in sorted(meta["files"])[rank::world]}
        found = _files_problem(path, share)
        if found is not None:
            problem = ("corrupt", f"checkpoint {path} {found}")
    except CheckpointFormatError as error:
        problem = ("format", str(error))
    except CheckpointError as error:
        problem = ("corrupt", str(error))
    first = next((p for p in _gather(problem) if p is not None), None)
    if first is not None:
        kind, message = first
        raise (CheckpointFormatError if kind == "format" else CheckpointError)(message)
    return meta


def newest_verified_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint of the run that verifies, or None; [(checkpoint, why), ...] for the newer
    ones that do not). A checkpoint of the earlier format stops the search with CheckpointFormatError:
    skipping past it would quietly restart the run from an older step or from scratch. Collective under
    torchrun."""
    skipped = []
    for candidate in reversed(_complete_checkpoints(Path(run_dir) / CHECKPOINTS_DIR)):
        try:
            verify_checkpoint(candidate)
        except CheckpointFormatError:
            raise
        except CheckpointError as error:
            skipped.append((candidate, str(error)))
            continue
        return candidate, skipped
    return None, skipped


# -- loading ---------------------------------------------------------------------------------------

def _one_line(error: BaseException) -> str:
    # DCP gathers per-rank failures, as (exception, traceback) pairs, into a CheckpointException whose
    # text is whole tracebacks; name the first failure instead.
    prefix = ""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (error, _) = next(iter(error.failures.items()))
        prefix = f"rank {rank}: "
    return prefix + one_line(error)


def _read_extra(path: Path, meta: dict, rank: int) -> dict:
    """This rank's extra file; a rank without one (the world size changed) gets rank 0's."""
    name = _extra_file(rank) if _extra_file(rank) in meta["files"] else _extra_file(0)
    try:
        return json.loads((path / name).read_text())
    except (ValueError, RecursionError) as error:  # bad JSON, or nested deeper than the parser goes
        raise CheckpointError(f"checkpoint {path}: {name} could not be read ({error})") from None


def check_model_shapes(path: str | Path, model_cfg: ModelConfig) -> None:
    """Raise a one-line CheckpointError unless the model meta.json's config builds is the one the checkpoint's
    .metadata records: first its size, counted from the config alone (a config edited to a far larger model
    is refused before anything is built), then every tensor's shape on the model built on the meta device
    (nothing allocated). A model is sized by meta.json's config only after the weights have confirmed it."""
    path = Path(path)
    try:
        recorded = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as error:
        raise CheckpointError(f"checkpoint {path}: {DCP_METADATA} could not be read ({_one_line(error)})") from None
    held = sum(math.prod(entry.size) for key, entry in recorded.items()
               if key.startswith("model.") and hasattr(entry, "size"))
    built = config_counts(model_cfg).state
    if held != built:
        raise CheckpointError(f"checkpoint {path}: the config in its {META_FILE} builds a model of {built:,} weights "
                              f"(model.n_blocks={model_cfg.n_blocks}, model.d_model={model_cfg.d_model}), the "
                              f"checkpoint holds {held:,}")
    for name, tensor in build_model(model_cfg, device="meta").state_dict().items():
        saved = getattr(recorded.get(f"model.{name}"), "size", None)
        if saved is None:
            raise CheckpointError(f"checkpoint {path} holds no weight {name}, which the config in its {META_FILE} "
                                  "builds")
        if tuple(saved) != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint {path}: the config in its {META_FILE} builds {name} of shape "
                                  f"{list(tensor.shape)}, the checkpoint holds {list(saved)}")


def load_checkpoint(path: str | Path, model: nn.Module, optimizers: list, scheduler, rank: int,
                    fingerprint: str | None = None, mesh=None, verify: bool = True) -> tuple[dict, dict]:
    """Load model, optimizers and scheduler in place; return (this rank's extra, meta).

    Pass optimizers=[] and scheduler=None to load the model only. Before any weight is touched the
    checkpoint is verified (verify_checkpoint; pass verify=False only for one newest_verified_checkpoint
    just returned) and, with `fingerprint`, a checkpoint of another model is refused (check_compatible).
    A rank without its own extra file (the world size changed) gets rank 0's; meta["world_size"] tells the caller.
    """
    path = Path(path)
    meta = verify_checkpoint(path) if verify else read_meta(path)
    if fingerprint is not None:
        check_compatible(meta, fingerprint, path)
    extra = _read_extra(path, meta, rank)
    reader = SafeFileSystemReader(path)
    try:
        metadata = reader.read_metadata()  # refuse a bad .metadata here, in one line, before DCP's collectives
    except Exception as error:
        raise CheckpointError(f"checkpoint {path}: {DCP_METADATA} could not be read ({_one_line(error)})") from None
    flat_optim = not nested_optimizer_layout(metadata)
    state = dcp_state(model, optimizers, scheduler, mesh, flat_optim)
    try:
        with _single_process_is_fine():
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner())
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} could not be read ({_one_line(error)})") from error
    if mesh is not None:
        state = from_global_state(state, model)
    if optimizers:
        optim_state = {**state["optim"], **_current_param_groups(model, optimizers)} if flat_optim else state["optim"]
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=optim_state,
                       options=_optim_options(flat_optim))
        if flat_optim and scheduler is not None:
            _restore_scheduled_lrs(scheduler)
    else:
        set_model_state_dict(model, state["model"])
    return extra, meta


def nested_optimizer_layout(metadata) -> bool:
    """Whether a checkpoint's DCP metadata holds the optimizer state nested, param groups by index (as
    written before the layout became flat; readable where every rank holds every parameter)."""
    return any(NESTED_PARAM_GROUP.fullmatch(key) for key in metadata.state_dict_metadata)


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
    override that sets it (`model.d_model=256 ... variant.kind=block`), so a mismatch says what to change."""
    flat = _flatten(dataclasses.asdict(model_cfg), "model.")
    flat = {key: value for key, value in flat.items() if key not in RESUMABLE_CHANGES}
    # A list is written as an override types it, without spaces (model.mla_layers=[3,7]): the items split at spaces.
    flat = {key: "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else value
            for key, value in flat.items()}
    return " ".join(f"{override_name(key)}={value}" for key, value in flat.items())


def override_name(key: str) -> str:
    """A config key as an override names it: residual options are set through the `variant` config group."""
    return key.replace("model.residual.", "variant.", 1)


# A fingerprint written before a key was renamed (trainer/config.py's RENAMED_KEYS) names it the old way.
FINGERPRINT_RENAMES = {override_name(old): override_name(new) for old, new in RENAMED_KEYS.items()}


def _parse_fingerprint(fingerprint: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in fingerprint.split() if "=" in item)


def fingerprint_difference(written: str, fingerprint: str) -> tuple[str, str] | None:
    """None when `written` and `fingerprint` describe the same model, else each side's `key=value`
    for only the keys that differ (written, then fingerprint)."""
    if written == fingerprint:
        return None
    theirs = {FINGERPRINT_RENAMES.get(key, key): value for key, value in _parse_fingerprint(written).items()}
    ours = _parse_fingerprint(fingerprint)
    # A checkpoint written before an option existed (e.g. variant.streams) was built with its default.
    defaults = _parse_fingerprint(model_fingerprint(ModelConfig()))
    theirs = {**{key: defaults[key] for key in ours if key not in theirs and key in defaults}, **theirs}
    differing = [key for key in dict.fromkeys([*theirs, *ours]) if theirs.get(key) != ours.get(key)]
    if not differing:
        return None

    def show(values: dict[str, str]) -> str:
        return " ".join(f"{key}={values.get(key, '<absent>')}" for key in differing)

    return show(theirs), show(ours)


def check_compatible(meta: dict, fingerprint: str, path: str | Path = "") -> None:
    """Raise CheckpointError naming only the differing keys when the checkpoint's model is not this run's."""
    written = meta.get("model_fingerprint")
    name = f"checkpoint {path}".rstrip()
    if written is None:
        raise CheckpointError(f"{name} has no model_fingerprint in its {META_FILE}; cannot tell which model wrote it")
    difference = fingerprint_difference(written, fingerprint)
    if difference is not None:
        theirs, ours = difference
        raise CheckpointError(f"{name} was written by {theirs}; this run has {ours}")
