"""Pretraining entry point: `python -m trainer.main [hydra overrides]`, under torchrun for many ranks."""
from __future__ import annotations

import sys

import hydra
import torch.distributed as dist
from omegaconf import DictConfig

from parallel.dims import init_distributed, shutdown
from parallel.failure import FailureBoard, one_line, watch_for_failures
from trainer.config import CONFIG_DIR, ConfigError, register_schemas, to_typed
from trainer.trainer import KNOWN_ERRORS, Trainer


def fail(message: str, code: int = 2) -> None:
    # One write call: print() writes the text and its newline separately, and under PYTHONUNBUFFERED each
    # is its own syscall, so the ranks of one job interleaved their lines in the shared stderr pipe.
    sys.stderr.write(f"error: {message}\n")
    sys.exit(code)


def _is_collective_timeout(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and dist.is_initialized() and "timed out" in str(error).lower()


def report_failure(error: BaseException, rank: int, board: FailureBoard | None) -> None:
    """One line for this rank's failure, recorded for the other ranks first (parallel/failure.py). A known
    error is its own message; an error that followed another rank's failure (a peer's socket closed under a
    collective) names that first failure; a collective timeout names its key; anything else goes on to its
    traceback."""
    first = board.fail(one_line(error)) if board is not None else None
    if board is not None and first is None:
        board.linger()
    if isinstance(error, KNOWN_ERRORS):
        fail(str(error).splitlines()[0] if str(error) else type(error).__name__)
    if first is not None:
        fail(f"rank {rank} stops because {first}", code=1)
    if _is_collective_timeout(error):
        fail(f"rank {rank}: a collective timed out (parallel.init_timeout_s until the first step has finished, "
             f"parallel.collective_timeout_s after it): {one_line(error)}", code=1)


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(raw: DictConfig) -> None:
    try:
        cfg = to_typed(raw)
    except ConfigError as error:
        fail(str(error))
    info = init_distributed(cfg.parallel.init_timeout_s)
    board = watch_for_failures(info.rank, info.world_size)
    try:
        Trainer(cfg, info).fit()
    except BaseException as error:
        # No barrier on the way out: a peer that has not failed waits in a collective, not in the barrier.
        report_failure(error, info.rank, board)
        raise
    if board is not None:
        board.close()
    shutdown()


if __name__ == "__main__":
    register_schemas()  # before @hydra.main composes configs/config.yaml, whose defaults list names them
    main()
