"""Pre-flight: validate the config, check the run directory (writable, not in use, room for a checkpoint)
and prepare the data and its sample indices in one process, before torchrun starts ranks.

    python -m trainer.check --nproc 2 [hydra overrides]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model.params import config_counts
from trainer.config import ConfigError, load_config, validate_layout
from trainer.data import open_samples
from trainer.run_dir.lock import check_run_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1, help="processes torchrun will start (data-parallel ranks)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.overrides)
        train = cfg.train
        validate_layout(cfg, args.nproc)
        check_run_dir(Path(cfg.run.dir).resolve(), config_counts(cfg.model).total)  # RunDirError is a RuntimeError
        # Prepared data and megatron-core's index cache, built here once so the ranks only read them.
        samples = open_samples(cfg.data, cfg.model.vocab_size, train.seq_len, cfg.seed)
        samples.build_for_run(train.steps, train.global_batch)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    print(f"config ok: model d={cfg.model.d_model} x {cfg.model.n_blocks} blocks, "
          f"variant={cfg.model.residual.kind}, data {samples.blend.describe()} "
          f"({samples.pass_samples} training samples a pass, {samples.val_samples} validation)", file=sys.stderr)


if __name__ == "__main__":
    main()
