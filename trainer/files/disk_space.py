"""Free space on a path's filesystem, and whether a failure was the disk filling up (however the writer
that hit it reported it)."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# PyTorch's zip writer (torch.save, DCP shards) reports a short write to a full disk as this, without errno.
TORCH_SHORT_WRITE = "unexpected pos"


def free_bytes(path: Path) -> int:
    """Free space (for unprivileged users) on the filesystem holding path or its nearest existing parent."""
    return shutil.disk_usage(nearest_existing(Path(path))).free


def nearest_existing(path: Path) -> Path:
    """path itself, or the closest parent of it that exists (where it would be created)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _errors_in(error: BaseException):
    """error, its causes and contexts, and the per-rank failures a DCP CheckpointException gathers."""
    seen, todo = set(), [error]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        todo += [failure for failure, _ in getattr(current, "failures", {}).values()]


def is_disk_full(error: BaseException) -> bool:
    for current in _errors_in(error):
        if isinstance(current, OSError) and current.errno in DISK_FULL:
            return True
        if TORCH_SHORT_WRITE in str(current) or os.strerror(errno.ENOSPC) in str(current):
            return True
    return False
