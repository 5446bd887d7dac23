"""Writing files without following a symlink, and finding the links planted in a directory we write.

A run directory, an export or a prepared dataset may have been handed over by someone else, so any of
its entries can be a link planted to make our next write land elsewhere (a `tokenizer.json` pointing at
~/.bashrc). `write_file` writes a temporary sibling created with O_EXCL | O_NOFOLLOW and renames it over
the path: a link there is replaced as a link, its target is never opened. `append_text` opens with
O_NOFOLLOW, so a link there is an error rather than a write to its target. `first_link` lets a writer
refuse such a directory in one line before it starts.

A link can also be planted after that check, in place of a directory the run writes under (checkpoints/
pointed at another run, whose checkpoints pruning would delete). So a write under a trusted `root` (the
run directory as the run resolved it at start) reaches its directory through `open_dir`: root's last
component and every directory below it opened with O_NOFOLLOW, each relative to the one before, so a link
anywhere on the way is a LinkedPathError naming it instead of a write to its target. What is then done
inside goes through `held_path`, /proc/self/fd/<fd>: the kernel resolves it to the directory held open,
whatever is renamed or linked on the way to it afterwards, so libraries that take a path (DCP, the
profiler, safetensors) write where we checked, and shutil.rmtree of an entry of it never leaves it.
"""
from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

NO_FOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkedPathError(ValueError):
    """A directory (or file) written under a trusted root is a symlink, or not a directory; planted after the
    start-up check. The message is one line naming it."""


def _shown(path: str | Path) -> str:
    text = os.fsdecode(path)
    return text if text.isprintable() else repr(text)  # a planted name may hold a newline


def _refusal(shown: Path, dir_fd: int | None, name: str, error: OSError) -> LinkedPathError | OSError:
    """The one-line error for `name` (in dir_fd, or a path) that O_NOFOLLOW refused; other errors unchanged."""
    if error.errno not in (errno.ELOOP, errno.ENOTDIR):
        return error
    try:
        target = os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return LinkedPathError(f"{_shown(shown)} is not a directory; a run writes only under the directories "
                               "it made: remove it")
    return LinkedPathError(f"{_shown(shown)} is a symlink (to {_shown(target)}), planted after the start-up check: "
                           "nothing is written or removed through a link, which could reach outside the directory "
                           "being written; remove the link and run again")


def open_dir(root: str | Path, relative: str | Path = "", create: bool = False) -> int:
    """A descriptor of root/relative opened without following a link at root's last component or below it
    (root's parents are the caller's own path); LinkedPathError naming the first link. create: make the
    missing directories below root, each inside the one just opened. The caller closes it."""
    root = Path(root)
    try:
        fd = os.open(root, NO_FOLLOW_DIR)
    except OSError as error:
        raise _refusal(root, None, str(root), error) from None
    shown = root
    for part in Path(relative).parts:
        shown = shown / part
        try:
            if create:
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
            child = os.open(part, NO_FOLLOW_DIR, dir_fd=fd)
        except OSError as error:
            refusal = _refusal(shown, fd, part, error)
            os.close(fd)
            raise refusal from None
        os.close(fd)
        fd = child
    return fd


def held_path(fd: int) -> Path:
    """A path that reaches the file or directory open as `fd` itself, not whatever its name leads to now."""
    return Path(f"/proc/self/fd/{fd}")


@contextmanager
def held_dir(root: str | Path, relative: str | Path = "", create: bool = False) -> Iterator[Path]:
    """open_dir for the length of a block, as its held_path."""
    fd = open_dir(root, relative, create)
    try:
        yield held_path(fd)
    finally:
        os.close(fd)


@contextmanager
def _parent(path: Path, root: str | Path | None) -> Iterator[Path]:
    """path's directory: under `root` held (made where missing) without following links; else as given."""
    if root is None:
        yield path.parent
    else:
        with held_dir(root, path.parent.relative_to(root), create=True) as parent:
            yield parent


def write_file(path: str | Path, data: str | bytes, root: str | Path | None = None) -> None:
    """Write `data` to `path` atomically; a symlink at `path` is replaced by the file, its target untouched.
    With `root` (a directory path is under), no link between root and path is followed either."""
    path = Path(path)
    with _parent(path, root) as parent:
        target = parent / path.name
        temporary = parent / f".{path.name}.tmp-{os.getpid()}"
        temporary.unlink(missing_ok=True)  # a leftover of a writer killed mid-write (or a link planted at that name)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "wb") as stream:
                stream.write(data.encode() if isinstance(data, str) else data)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise


def append_text(path: str | Path, text: str, root: str | Path | None = None) -> None:
    """Append `text` to `path`, creating it; a symlink at `path` (or, with `root`, between root and path) is a
    LinkedPathError instead of being followed."""
    path = Path(path)
    with _parent(path, root) as parent:
        try:
            fd = os.open(parent / path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            raise _refusal(path, None, str(parent / path.name), error) from None
        with os.fdopen(fd, "a") as stream:
            stream.write(text)


@contextmanager
def file_for_library(path: str | Path, root: str | Path) -> Iterator[Path]:
    """A path to hand a library that writes a file by name (torch.profiler's trace, whose writer makes its own
    temporary file beside it): a temporary name in path's directory, held (made where missing) under `root`
    without following a link, renamed to `path` when the block ends and removed if it fails."""
    path = Path(path)
    with _parent(path, root) as parent:
        temporary = parent / f".{path.name}.tmp-{os.getpid()}"
        temporary.unlink(missing_ok=True)  # a link planted at that name would be followed by the library's open()
        try:
            yield temporary
            os.replace(temporary, parent / path.name)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise


def check_still(held: Path, entry: Path, shown: Path) -> None:
    """LinkedPathError unless `entry` (not followed) is the directory `held` holds open: one renamed away,
    or replaced by a link or another directory, is not published as ours."""
    try:
        same = os.path.samestat(os.stat(held), os.lstat(entry))  # a link at entry is an inode of its own
    except FileNotFoundError:
        same = False
    if not same:
        raise LinkedPathError(f"{_shown(shown)} was replaced or moved while it was being written; nothing was "
                              "published from it: find out what changed the directory, then run again")


def remove_entry(path: Path) -> None:
    """Delete a directory tree, or only the link if `path` is one (its target is not ours). Pass a path
    inside a held_dir: its last component is then the only one that could be a link."""
    if os.path.islink(path) or not os.path.isdir(path):
        path.unlink()
    else:
        shutil.rmtree(path)


def first_link(directory: str | Path, skip: tuple[str, ...] = ()) -> Path | None:
    """The first symlink at any depth under `directory` (not counting `directory` itself, nor what is under
    its top-level entries named in `skip`), or None. Links are not followed."""
    directory = Path(directory)
    for parent, subdirs, files in os.walk(directory):
        for name in sorted(subdirs + files):
            if os.path.islink(os.path.join(parent, name)):
                return Path(parent, name)
        if Path(parent) == directory:
            subdirs[:] = [name for name in subdirs if name not in skip]
    return None
