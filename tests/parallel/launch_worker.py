"""Run under torchrun: every job of a JSON file in turn, in one process group, so that the suite pays for one
launch per world size rather than one per test (a launch costs each rank 3-5 CPU-seconds of imports before
its first step, and the agent and fork server as much again). Used through tests/conftest.py (`launched`,
`torchrun_runs`), which starts it with preloaded_launch.py: importing this module imports what every job
needs, the parity workers and megatron-core's datasets included, so the fork server does it once for all ranks.

A job is {"directory": D, "runs": [Hydra override lists]} (trainer runs, one after another) or
{"directory": D, "parity": WORKER} (a parity worker's run(info), which prints its report on rank 0). Each
rank's stdout and stderr during a job go to D/rank<r>.stdout and D/rank<r>.stderr, so a test reads its own
job's output; D/done marks a job every rank finished.

    python tests/parallel/preloaded_launch.py 2 launch_worker JOBS.json
"""
import importlib
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

import fsdp_parity_worker  # noqa: F401  preloaded for the parity jobs
import pp_parity_worker  # noqa: F401
import tp_parity_worker  # noqa: F401
from parallel.dims import init_distributed, shutdown
from trainer.config import load_config
from trainer.data.mcore import megatron_datasets
from trainer.trainer import Trainer

# Every run opens its data with these and composes its config with Hydra, each imported on first use otherwise:
# in the fork server, once for all ranks.
megatron_datasets()
load_config([])


@contextmanager
def output_into(directory: Path, rank: int):
    """This rank's file descriptors 1 and 2 (print, logging, C++ warnings alike) into the job's files."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    try:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            with open(directory / f"rank{rank}.{name}", "w") as file:
                os.dup2(file.fileno(), fd)
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


def main(jobs_file: str) -> None:
    info = init_distributed()
    try:
        for job in json.loads(Path(jobs_file).read_text()):
            directory = Path(job["directory"])
            start = time.perf_counter()
            print(f"launch_worker: rank {info.rank} starts {directory}", file=sys.stderr, flush=True)
            with output_into(directory, info.rank):
                if "parity" in job:
                    importlib.import_module(job["parity"]).run(info)
                for overrides in job.get("runs", []):
                    Trainer(load_config(overrides), info).fit()
            dist.barrier()
            if info.rank == 0:
                (directory / "done").touch()
                print(f"launch_worker: {directory.name} took {time.perf_counter() - start:.1f} s", file=sys.stderr,
                      flush=True)
    finally:
        shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
