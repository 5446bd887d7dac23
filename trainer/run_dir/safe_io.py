"""Writing files without following a symlink, and finding the links planted in a directory we write.

A run directory, an export or a prepared dataset may have been handed over by someone else, so any of
its entries can be a link planted to make our next write land elsewhere (a `tokenizer.json` pointing at
~/.bashrc). `write_file` writes a temporary sibling created with O_EXCL | O_NOFOLLOW and renames it over
the path: a link there is replaced as a link, its target is never opened. `append_text` opens with
O_NOFOLLOW, so a link there is an error rather than a write to its target. `first_link` lets a writer
refuse such a directory in one line before it starts.
"""
from __future__ import annotations

import os
from pathlib import Path


def write_file(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` atomically; a symlink at `path` is replaced by the file, its target untouched."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)  # a leftover of a writer killed mid-write (or a link planted at that name)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data.encode() if isinstance(data, str) else data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def append_text(path: str | Path, text: str) -> None:
    """Append `text` to `path`, creating it; a symlink at `path` raises OSError (ELOOP) instead of being followed."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "a") as stream:
        stream.write(text)


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
