"""Run under torchrun: train each run of a JSON file (a list of Hydra override lists) in turn, in one
process group, so that a test pays for one launch of its processes rather than one per run (a launch
costs 3-5 CPU-seconds a process before the first step). Used through conftest.torchrun_runs, which
starts it with preloaded_launch.py: importing this module imports what every run needs, megatron-core's
datasets included, so the fork server does it once for all ranks.

    torchrun --nproc-per-node 4 tests/parallel/trainer_runs_worker.py RUNS.json
"""
import json
import sys
from pathlib import Path

from parallel.dims import init_distributed, shutdown
from trainer.config import load_config
from trainer.data.mcore import megatron_datasets
from trainer.trainer import Trainer

megatron_datasets()  # every run opens its data with these (imported on first use otherwise)


def main(runs_file: str) -> None:
    info = init_distributed()
    try:
        for overrides in json.loads(Path(runs_file).read_text()):
            Trainer(load_config(overrides), info).fit()
    finally:
        shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
