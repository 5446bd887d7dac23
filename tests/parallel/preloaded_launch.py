"""torchrun's agent, with its workers forked from one fork server that has imported the worker module (and
with it torch's distributed stack, the model and the trainer) once per launch instead of once per rank.
Those imports cost a rank 3-5 CPU-seconds (idle to busy machine) before its first step, most of what a
test's launch of a few tiny steps on 2-16 ranks costs on a 2-core machine. The workers are what torchrun starts: the same agent
(torch.distributed.launcher, standalone c10d rendezvous), the same environment (RANK, WORLD_SIZE,
MASTER_ADDR, TORCHELASTIC_USE_AGENT_STORE, ...), fresh process groups. Used by the launches of
tests/conftest.py (launch_worker.py: the session's launch per world size); the tests of launching itself
(restarts, refusals, the run lock) start `torchrun -m trainer.main` as a user does.

    python tests/parallel/preloaded_launch.py NPROC WORKER [ARG ...]

WORKER is a module beside this file whose main(*ARGS) each rank runs.
"""
import importlib
import multiprocessing
import os
import sys
import uuid
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def run_worker(worker: str, args: list[str]) -> None:
    if worker not in sys.modules:  # the fork server skips a preload it cannot import, silently
        raise RuntimeError(f"the fork server did not preload {worker}: each rank would import it on its own")
    importlib.import_module(worker).main(*args)


def main(nproc: str, worker: str, *args: str) -> None:
    # The fork server starts with the interpreter's default sys.path (before Python 3.13 it drops the one it
    # is given), so it finds the workers beside this file through PYTHONPATH.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    multiprocessing.set_forkserver_preload([worker])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=int(nproc), run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          start_method="forkserver")
    elastic_launch(config, run_worker)(worker, list(args))


if __name__ == "__main__":
    main(*sys.argv[1:])
