"""Writing files without following symlinks, and copying only regular files.

A run directory, an export or a prepared dataset may have been handed over by someone else, so any of
its entries can be a link planted to make our next write land elsewhere (a `config.yaml` pointing at
~/.bashrc). Every file the trainer, export and preparation write goes through these:
  write_file     a temporary sibling created with O_EXCL | O_NOFOLLOW, then renamed over the path: a link
                 there is replaced as a link, its target is never opened
  open_append    O_APPEND | O_NOFOLLOW: appending to a link is refused in one line
  copy_regular   copies a regular file only (no link, no FIFO or device), checked on the opened descriptor
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import IO, Callable


class UnsafePathError(ValueError):
    """A path that is a symlink or not a regular file where a regular file is required; the message is one line."""


def _link_message(path: Path, what: str) -> str:
    target = os.readlink(path) if path.is_symlink() else "?"
    return f"{path} is a symlink (to {target}); {what}: replace the link with a regular file or remove it"


def _replace_with(path: Path, fill: Callable[[IO[bytes]], None]) -> None:
    """Fill a temporary sibling created with O_EXCL | O_NOFOLLOW, then rename it over `path`."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)  # a leftover of a writer killed mid-write (or a link planted at that name)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as stream:
            fill(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_file(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` atomically; a symlink at `path` is replaced by the file, its target untouched."""
    payload = data.encode() if isinstance(data, str) else data
    _replace_with(Path(path), lambda stream: stream.write(payload))


def open_append(path: str | Path) -> IO[str]:
    """`path` opened for appending text, created if missing; a symlink there raises UnsafePathError."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        if path.is_symlink():
            raise UnsafePathError(_link_message(path, "refusing to append through it")) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path} is not a regular file; refusing to append to it")
    return os.fdopen(fd, "a")


def copy_regular(source: str | Path, target: str | Path) -> None:
    """Copy `source` to `target` (written as write_file does), refusing a source that is a symlink or not
    a regular file; the check is made on the opened descriptor, so a link swapped in after a check is refused too."""
    source = Path(source)
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        if source.is_symlink():
            raise UnsafePathError(_link_message(source, "only regular files are copied")) from None
        raise UnsafePathError(f"{source} cannot be copied as a regular file ({error.strerror})") from None
    with os.fdopen(fd, "rb") as reader:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(f"{source} is not a regular file; only regular files are copied")
        _replace_with(Path(target), lambda writer: shutil.copyfileobj(reader, writer))


def refuse_links(directory: str | Path, names: tuple[str, ...] | list[str], what: str) -> None:
    """One line naming the first of `names` inside `directory` that is a symlink."""
    directory = Path(directory)
    for name in names:
        entry = directory / name
        if entry.is_symlink():
            raise UnsafePathError(_link_message(entry, what))
