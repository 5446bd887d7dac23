"""`finished.json`: the step a run finished at, which outlives its checkpoints.

A finished run's checkpoints may be deleted to free disk (its metrics, config and depth matrix are what a
comparison keeps). Without a record, the next `resume=auto` launch finds no checkpoint, trains the run
again from step 0 and drops its metrics rows; with one, the trainer refuses and the comparison tool skips it.
"""
from __future__ import annotations

import json
from pathlib import Path

from trainer.run_dir.checkpoint import CheckpointError
from trainer.run_dir.safe_io import write_file

FINISHED_FILE = "finished.json"  # {"step": N}


def record_finished(run_dir: str | Path, step: int) -> None:
    write_file(Path(run_dir) / FINISHED_FILE, json.dumps({"step": step}) + "\n")


def finished_step(run_dir: str | Path) -> int:
    """The step finished.json records; 0 without the file; CheckpointError in one line if it is malformed."""
    marker = Path(run_dir) / FINISHED_FILE
    if not marker.is_file():
        return 0
    try:
        record = json.loads(marker.read_text())
    except (ValueError, OSError) as error:
        raise CheckpointError(f"{marker} could not be read ({str(error).splitlines()[0]}); expected "
                              '{"step": N}') from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{marker} holds a JSON {type(record).__name__}; expected " '{"step": N}')
    step = record.get("step")
    if type(step) is not int or step <= 0:
        raise CheckpointError(f"{marker} has step {step!r}; expected a positive integer")
    return step
