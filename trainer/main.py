"""Pretraining entry point: `python -m trainer.main [hydra overrides]`, under torchrun for many ranks."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from parallel.dims import init_distributed, shutdown
from trainer.config import CONFIG_DIR, ConfigError, to_typed
from trainer.trainer import KNOWN_ERRORS, Trainer


def fail(message: str) -> None:
    # One write call: print() writes the text and its newline separately, and under PYTHONUNBUFFERED each
    # is its own syscall, so the ranks of one job interleaved their lines in the shared stderr pipe.
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(raw: DictConfig) -> None:
    try:
        cfg = to_typed(raw)
    except ConfigError as error:
        fail(str(error))
    info = init_distributed(cfg.parallel.init_timeout_s)
    try:
        Trainer(cfg, info).fit()
    except KNOWN_ERRORS as error:
        fail(str(error).splitlines()[0] if str(error) else type(error).__name__)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
