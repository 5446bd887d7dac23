"""Owning a run directory: one run at a time per run.dir, and one-line errors when it cannot be written.

The lock is `<run.dir>/.trainer.lock`, held with fcntl.flock by rank 0 for the whole run and recording
`{"host", "pid", "started"}` so a refusal can name the holder. The kernel drops a flock when its holder
dies (kill -9, OOM killer, a crashed rank restarted by torchrun), so a lock left by a dead process never
blocks the next run: the file is still there, the lock on it is not, and the next run takes it over.
A run that ends (normally or by an exception) deletes the file, so a finished run directory holds none.
Only rank 0 locks; the other ranks of the job learn its outcome (lock_run_dir) and trust it.

What is guaranteed where:
  - one machine, local disk: complete; two runs on one run.dir cannot both hold the lock.
  - a shared filesystem across nodes: as good as that filesystem's flock. NFSv4 (and NFSv3 with lockd)
    turn flock into byte-range locks the server arbitrates, so runs on different nodes exclude each other;
    Lustre does too when mounted with `-o flock`, but with `-o localflock` only runs on the same node do.
    A node cut off from the NFS server past its lease (NFSv4: about 90 s) loses its lock while it runs.
  - a filesystem without flock (ENOLCK/EOPNOTSUPP/ENOSYS: some FUSE mounts, Lustre without a flock option):
    the lock falls back to the recorded holder. A holder on this host whose pid is gone is stale and is
    taken over; a holder on another host cannot be checked from here, so the run is refused and the
    message names the file to delete once that run is known to be gone.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch.distributed as dist

from trainer.files.disk_space import free_bytes, nearest_existing
from trainer.files.safe_io import first_link

LOCK_FILE = ".trainer.lock"
WANDB_DIR = "wandb"  # wandb's own directory, which holds its `latest-run` link
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
BYTES_PER_PARAM_IN_CHECKPOINT = 4 * 3  # fp32 weights + AdamW's two moments


class RunDirError(RuntimeError):
    """The run directory is in use, cannot be written or is full; the message is one line."""


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (started {holder.get('started', '?')})"


def _read_holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _in_use(run_dir: Path, holder: dict) -> RunDirError:
    return RunDirError(f"run.dir={run_dir} is in use by another run: {_describe(holder)}; wait for it to finish "
                       "or stop it, or pick another run.dir")


def make_run_dir(run_dir: Path) -> None:
    """Create run_dir, or raise RunDirError saying why it cannot be."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunDirError(f"run.dir={run_dir} cannot be created ({error.strerror}: {error.filename}); "
                          "pick a writable run.dir") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):  # also false for root on a read-only mount
        raise RunDirError(f"run.dir={run_dir} is not writable; pick a writable run.dir")
    refuse_links(run_dir)


def refuse_links(run_dir: Path) -> None:
    """A run directory holds only what runs wrote there; a symlink in it (config.yaml -> ~/.bashrc, a
    checkpoints/step_N -> elsewhere) would send a write, an append or a pruning rmtree to its target."""
    link = first_link(run_dir, skip=(WANDB_DIR,))
    if link is not None:
        raise RunDirError(f"run.dir={run_dir}: {link.relative_to(run_dir)} is a symlink (to {os.readlink(link)}); "
                          "a run directory must hold only regular files and directories, since a link would "
                          "redirect the run's writes; remove it or pick another run.dir")


class RunDirLock:
    """The lock of one run directory, held by one process. `acquire` raises RunDirError if another live
    process holds it; `taken_over` is then the holder record of a dead process whose lock was taken over."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None
        self.taken_over: dict | None = None

    def acquire(self) -> RunDirLock:
        make_run_dir(self.run_dir)
        try:
            try:
                while self.fd is None:
                    self._try_flock()
            except OSError as error:
                if error.errno not in NO_FLOCK:
                    raise
                self._create_without_flock()
            self._record_holder()
        except OSError as error:
            self.release()
            raise RunDirError(f"run.dir={self.run_dir}: cannot write {LOCK_FILE} ({error.strerror}); "
                              "pick a writable run.dir with free space") from None
        return self

    def _try_flock(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(self.run_dir, _read_holder(self.path)) from None
        except OSError:
            os.close(fd)
            raise
        # A holder that released deletes the file; if it did so between our open and our flock we hold a
        # lock on a deleted file, so start over on the file now at that path.
        try:
            same_file = os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            same_file = False
        if not same_file:
            os.close(fd)
            return
        self.fd = fd

    def _create_without_flock(self) -> None:
        """The fallback on filesystems without flock: the file's existence is the lock."""
        holder = _read_holder(self.path)  # empty: the file our flock attempt created
        if holder.get("host", socket.gethostname()) != socket.gethostname():
            raise RunDirError(f"run.dir={self.run_dir} is marked in use by {_describe(holder)} and this "
                              f"filesystem has no file locks to check it; if that run is gone, delete "
                              f"{self.path}")
        if holder and pid_alive(int(holder.get("pid", 0))):
            raise _in_use(self.run_dir, holder)
        self.taken_over = holder or None
        self.path.unlink(missing_ok=True)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            raise _in_use(self.run_dir, _read_holder(self.path)) from None

    def _record_holder(self) -> None:
        if self.taken_over is None:  # a released lock leaves no file behind, so a recorded holder died
            self.taken_over = _read_holder(self.path) or None
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(record) + "\n").encode(), 0)

    def release(self) -> None:
        """Delete the file, then drop the lock (in that order, so the next holder finds a fresh file)."""
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None


def lock_run_dir(run_dir: Path, is_main: bool) -> RunDirLock | None:
    """Rank 0 takes the lock; every rank of the process group learns the outcome and raises the same
    RunDirError on refusal, so all ranks exit together. Returns the held lock on rank 0, None elsewhere."""
    lock, refusal = None, None
    if is_main:
        try:
            lock = RunDirLock(run_dir).acquire()
        except RunDirError as error:
            refusal = str(error)
    if dist.is_available() and dist.is_initialized():
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)
        refusal = shared[0]
    if refusal is not None:
        raise RunDirError(refusal)
    if lock is not None and lock.taken_over:
        print(f"run.dir={run_dir}: took over the lock of {_describe(lock.taken_over)}, which is no longer "
              "running", file=sys.stderr)
    return lock


def holder_if_locked(run_dir: Path) -> dict | None:
    """The holder record if a live process holds run_dir's lock, else None. Only reads: a shared flock
    taken and dropped at once (trainer.check's pre-flight)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(path)
    except OSError:  # no flock here: the record is all there is
        holder = _read_holder(path)
        alive = holder.get("host") != socket.gethostname() or pid_alive(int(holder.get("pid", 0)))
        return holder if holder and alive else None
    finally:
        os.close(fd)
    return None


def check_run_dir(run_dir: Path, n_params: int) -> None:
    """trainer.check's pre-flight, which changes nothing on disk: run_dir (or the parent it would be
    created in) is a writable directory, no live run holds it, and its filesystem has room for a checkpoint."""
    run_dir = Path(run_dir)
    existing = nearest_existing(run_dir)
    if not existing.is_dir():
        raise RunDirError(f"run.dir={run_dir} cannot be created: {existing} is a file; pick another run.dir")
    if not os.access(existing, os.W_OK | os.X_OK):  # also false for root on a read-only mount
        raise RunDirError(f"run.dir={run_dir} is not writable ({existing} is read-only to this user); "
                          "pick a writable run.dir")
    if run_dir.is_dir():
        refuse_links(run_dir)
    holder = holder_if_locked(run_dir)
    if holder is not None:
        raise _in_use(run_dir, holder)
    check_room(run_dir, n_params)


def check_room(run_dir: Path, n_params: int) -> None:
    """RunDirError unless run_dir's filesystem has room for one checkpoint of an n_params model."""
    need, free = checkpoint_bytes(n_params), free_bytes(run_dir)
    if free < need:
        raise RunDirError(f"run.dir={run_dir} has {free / 2**20:.1f} MiB free but one checkpoint of this model "
                          f"({n_params / 1e6:.1f}M parameters, fp32 weights + AdamW moments) needs about "
                          f"{need / 2**20:.1f} MiB; free some space or pick another run.dir")


def checkpoint_bytes(n_params: int) -> int:
    """About what one checkpoint of an AdamW run takes on disk."""
    return n_params * BYTES_PER_PARAM_IN_CHECKPOINT


def disk_full_error(run_dir: Path, step: int, latest: Path | None) -> RunDirError:
    kept = f"the previous checkpoints are kept (latest {latest.name})" if latest else "no checkpoint was written yet"
    return RunDirError(f"no space left on the device of run.dir={run_dir} at step {step} "
                       f"({free_bytes(run_dir) / 2**20:.1f} MiB free); {kept}; free some space, then run again "
                       "with resume=auto")
