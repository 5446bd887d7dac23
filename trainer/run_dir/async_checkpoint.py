"""checkpoint.async_mode: saves whose write overlaps the next training steps (DCP's async_save).

A save runs trainer/run_dir/checkpoint.py's three parts. begin_save (refuse non-finite weights, the empty
.tmp-step_N, this rank's extra file) and the staging of the state into host memory block the step; DCP's
write and this rank's share of the checksums run on background threads; publish (meta.json, the rename
into place, pruning) runs on the training thread only once every rank's write has finished. A run killed
before that leaves a .tmp-step_N without meta.json, which resume=auto never takes and the next start
removes. At most one save is in flight: the next save, and the end of training, wait for it first.

The background writes talk over their own gloo group, so their collectives never interleave with the
training's on the default group (torchtitan does the same). `async` stages into ordinary host memory,
fresh each save; `async_pinned` keeps one pinned staging copy across saves (faster device-to-host copies;
CUDA only), which costs that much host memory for the whole run.
"""
from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainer.run_dir.checkpoint import (PendingSave, begin_save, dcp_state, hash_share, merge_shares, publish,
                                        save_checkpoint)

@dataclass
class _InFlight:
    pending: PendingSave
    meta: dict
    keep_last: int
    hashed: Future  # this rank's hash_share, once its DCP write has finished


class CheckpointSaver:
    """Saves checkpoints synchronously (`off`) or in the background. Every rank calls every method at the
    same step: save, then poll after each step, wait at the end of training, close always."""

    def __init__(self, mode: str, device: torch.device):
        self.mode, self.device = mode, device
        self.in_flight: _InFlight | None = None
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        background = mode != "off"
        self.group = dist.new_group(backend="gloo") if background and dist.is_initialized() else None
        if background and self.group is None:
            # DCP warns on every write without a process group; one process is a supported mode here. The
            # write runs on DCP's thread, where checkpoint.py's catch_warnings does not reach.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash") if background else None
        pinned = mode == "async_pinned"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=True)) if pinned else None

    def save(self, run_dir: Path, step: int, model: nn.Module, optimizers: list, scheduler, extra: dict,
             meta: dict, keep_last: int, mesh=None) -> Path:
        """save_checkpoint's arguments. Off: the checkpoint is published when this returns. Else this returns
        once the state is staged; the checkpoint is published by a later poll or wait."""
        if self.mode == "off":
            return save_checkpoint(run_dir, step, model, optimizers, scheduler, extra, meta, keep_last, mesh)
        self.wait()
        pending = begin_save(run_dir, step, model, extra)
        try:
            # A thread, not DCP's process-based writer: pending.target is a /proc/self path of this process.
            written = dcp.async_save(dcp_state(model, optimizers, scheduler, mesh), checkpoint_id=pending.target,
                                     storage_writer=FileSystemWriter(pending.target), process_group=self.group,
                                     async_stager=self.stager, no_dist=self.group is None)
        except BaseException:
            pending.close()
            raise
        hashed = self.hasher.submit(self._hash_when_written, written, pending.target)
        self.in_flight = _InFlight(pending, meta, keep_last, hashed)
        return pending.final

    def _hash_when_written(self, written: Future, tmp: Path) -> dict[str, dict]:
        # Every rank's DCP write returns only after rank 0 wrote .metadata, which follows every rank's data:
        # the directory is complete when this rank lists it.
        written.result()
        return hash_share(tmp, self.rank, self.world)

    def poll(self) -> Path | None:
        """Publish the save in flight if every rank's write has finished (a collective while one is in
        flight); returns the checkpoint published, if any."""
        if self.in_flight is None:
            return None
        done = torch.tensor([float(self.in_flight.hashed.done())], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self.wait() if done.item() > 0 else None

    def wait(self) -> Path | None:
        """Block until the save in flight is written, then publish it; returns it (None if there was none).
        A failed write raises here, on the training thread, and leaves only its .tmp-step_N."""
        if self.in_flight is None:
            return None
        saving, self.in_flight = self.in_flight, None
        try:
            files = merge_shares(saving.hashed.result())
            publish(saving.pending, saving.meta, saving.keep_last, files)
        finally:
            saving.pending.close()
        return saving.pending.final

    def close(self) -> None:
        """Release the threads, the staging memory and the gloo group without publishing: after a failure, a
        save still in flight stays a .tmp-step_N (its write finishes before the process exits, so its group
        and the handle it writes through are left to the process's end)."""
        if self.hasher is not None:
            self.hasher.shutdown(wait=False)
        if self.stager is not None:
            self.stager.close()
        if self.group is not None and self.in_flight is None:
            # scripts/compare trains its runs one after another in one process: each would keep its group.
            dist.destroy_process_group(self.group)
            self.group = None
