"""Prepare a tokenised pretraining corpus by hand: what the trainer and trainer.check do on first use.

    python -m scripts.prepare_data [--cache-dir DIR] [--vocab-size 8192] [--source shakespeare|PATH]
                                   [--tokenizer tokenizer.json]

The dataset lands in --cache-dir under the same name the trainer looks for with the same data.path,
data.tokenizer and model.vocab_size, so one node can prepare it on a shared directory for all ranks.
Prints the prepared path on stdout. The format and the preparation live in trainer/data/.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.data import DataError, default_cache_dir, resolve_dataset
from trainer.data.prepare import DEFAULT_VOCAB_SIZE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $ATTNRES_DATA_CACHE or ~/.cache/attnres/data")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"model.vocab_size: the BPE's size (default {DEFAULT_VOCAB_SIZE}); "
                             "with --tokenizer, the most ids it may have (default: any)")
    parser.add_argument("--source", default="shakespeare",
                        help="'shakespeare', or data.path: a .txt/.jsonl file or directory, a prepared dataset")
    parser.add_argument("--tokenizer", default=None, help="data.tokenizer: a tokenizers tokenizer.json to use instead of training a BPE")
    args = parser.parse_args(argv)
    vocab_size = args.vocab_size
    if vocab_size is None and args.tokenizer is None:
        vocab_size = DEFAULT_VOCAB_SIZE
    source = None if args.source == "shakespeare" else args.source
    try:
        prepared = resolve_dataset(source, args.cache_dir or default_cache_dir(), vocab_size, args.tokenizer)
    except (DataError, FileNotFoundError) as e:  # DataError covers DataPreparationError and DatasetCorruptError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(prepared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
