"""Prepare a tokenised pretraining corpus by hand: what the trainer and trainer.check do on first use.

    python -m scripts.prepare_data [--cache-dir DIR | --out DIR] [--vocab-size 8192] [--source shakespeare|PATH ...]
                                   [--tokenizer tokenizer.json] [--workers N] [--on-error stop|skip]

Without --out the dataset lands in --cache-dir under the same name the trainer looks for with the same data.path,
data.tokenizer and model.vocab_size, so one node can prepare it on a shared directory for all ranks. With --out,
the sources (files, directories or globs of .txt/.jsonl/.jsonl.gz/.jsonl.zst/.parquet) become one dataset in DIR.
A killed preparation continues where it stopped when started again. Prints the prepared path on stdout. The
format (Megatron .bin/.idx with a manifest) and the preparation live in trainer/data/.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.data import DataError, PrepareOptions, default_cache_dir, prepare_text_corpus, resolve_dataset
from trainer.data.prepare import DEFAULT_VOCAB_SIZE, ON_ERROR


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--cache-dir", type=Path, default=None, help="default: $ATTNRES_DATA_CACHE or ~/.cache/attnres/data")
    where.add_argument("--out", type=Path, default=None, help="prepare the text sources into exactly this directory")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"model.vocab_size: the BPE's size (default {DEFAULT_VOCAB_SIZE}); "
                             "with --tokenizer, the most ids it may have (default: any)")
    parser.add_argument("--source", nargs="+", default=["shakespeare"],
                        help="'shakespeare', or data.path: text files, directories or globs, a prepared dataset")
    parser.add_argument("--tokenizer", default=None, help="data.tokenizer: a tokenizers tokenizer.json to use instead of training a BPE")
    parser.add_argument("--workers", type=int, default=1, help="processes tokenising input files at once")
    parser.add_argument("--on-error", default="stop", choices=ON_ERROR,
                        help="an unreadable or undecodable input file stops the preparation, or is skipped")
    args = parser.parse_args(argv)
    vocab_size = args.vocab_size
    if vocab_size is None and args.tokenizer is None:
        vocab_size = DEFAULT_VOCAB_SIZE
    try:
        options = PrepareOptions(args.workers, args.on_error)
        if args.out is not None:
            if "shakespeare" in args.source:
                raise DataError("--out takes text sources; the default corpus (shakespeare) is prepared into "
                                "--cache-dir under the name the trainer looks for")
            prepared = prepare_text_corpus(args.source, args.out, vocab_size, args.tokenizer, options)
        elif len(args.source) > 1:
            raise DataError(f"--source names {len(args.source)} sources; without --out it takes one (data.path), "
                            "with --out DIR several become one dataset")
        else:
            source = None if args.source[0] == "shakespeare" else args.source[0]
            prepared = resolve_dataset(source, args.cache_dir or default_cache_dir(), vocab_size, args.tokenizer,
                                       options)
    except (DataError, FileNotFoundError) as e:  # DataError covers DataPreparationError and DatasetCorruptError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(prepared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
