"""Writing a file without following a symlink.

A run directory, an export or a prepared dataset may have been handed over by someone else, so any of
its entries can be a link planted to make our next write land elsewhere (a `tokenizer.json` pointing at
~/.bashrc). `write_file` writes a temporary sibling created with O_EXCL | O_NOFOLLOW and renames it over
the path: a link there is replaced as a link, its target is never opened. Data preparation writes through
it; the run directory's writers do not yet (issue 24, cause 1).
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
