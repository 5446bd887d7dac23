"""`finished.json`: the step a run finished at, which outlives its checkpoints.

A finished run's checkpoints may be deleted to free disk (its metrics, config and depth matrix are what a
comparison keeps). Without a record, the next `resume=auto` launch finds no checkpoint, trains the run
again from step 0 and drops its metrics rows; with one, the trainer refuses and the comparison tool skips it.

Anything at finished.json but a regular file (a directory, a fifo) is refused when it is read, which the
trainer does at start-up: a run is stopped before it trains rather than at its end, where the record could
not be written over it.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from trainer.run_dir.checkpoint import CheckpointError
from trainer.files.safe_io import write_file

FINISHED_FILE = "finished.json"  # {"step": N}
EXPECTED = '{"step": N}'


def record_finished(run_dir: str | Path, step: int) -> None:
    """Write finished.json; CheckpointError in one line if something put in its place since the start-up
    check (a directory) refuses it: the checkpoints are written by then and stay."""
    marker = Path(run_dir) / FINISHED_FILE
    try:
        write_file(marker, json.dumps({"step": step}) + "\n", root=run_dir)
    except OSError as error:
        raise CheckpointError(f"{marker} could not be written ({error.strerror}); the run finished at step {step} "
                              f"and its checkpoints are kept: remove what is at {marker} and write "
                              f'{{"step": {step}}} there before ever deleting them') from None


def finished_step(run_dir: str | Path) -> int:
    """The step finished.json records; 0 without the file; CheckpointError in one line if it is malformed or
    not a regular file."""
    marker = Path(run_dir) / FINISHED_FILE
    try:
        mode = os.lstat(marker).st_mode
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
        raise CheckpointError(f"{marker} is {kind}, not the file {EXPECTED} a finished run leaves; remove it (the "
                              "run's checkpoints still tell how far it trained)")
    try:
        record = json.loads(marker.read_text())
    except (ValueError, OSError, RecursionError) as error:  # RecursionError: nested deeper than the parser goes
        raise CheckpointError(f"{marker} could not be read ({(str(error) or type(error).__name__).splitlines()[0]}); "
                              f"expected {EXPECTED}") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{marker} holds a JSON {type(record).__name__}; expected {EXPECTED}")
    step = record.get("step")
    if type(step) is not int or step <= 0:
        raise CheckpointError(f"{marker} has step {step!r}; expected a positive integer")
    return step
