"""Prepare a tokenised pretraining corpus by hand: what the trainer and trainer.check do on first use.

    python -m scripts.prepare_data [cache_dir=DIR | out=DIR] [vocab_size=8192] [source=shakespeare|PATH|[PATH,...]]
                                   [tokenizer=tokenizer.json] [workers=N] [on_error=stop|skip]

Without out= the dataset lands in cache_dir under the same name the trainer looks for with the same data.path,
data.tokenizer and model.vocab_size, so one node can prepare it on a shared directory for all ranks. With out=,
the sources (files, directories or globs of .txt/.jsonl/.jsonl.gz/.jsonl.zst/.parquet) become one dataset in DIR.
A killed preparation continues where it stopped when started again. Prints the prepared path on stdout. The
format (Megatron .bin/.idx with a manifest) and the preparation live in trainer/data/.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from scripts.cli import key, parse
from trainer.data import DataError, PrepareOptions, default_cache_dir, prepare_text_corpus, resolve_dataset
from trainer.data.prepare import DEFAULT_VOCAB_SIZE, ON_ERROR


@dataclass
class Args:
    cache_dir: str | None = key(None, "where the trainer looks for prepared data (null: $ATTNRES_DATA_CACHE or "
                                      "~/.cache/attnres/data)")
    out: str | None = key(None, "prepare the text sources into exactly this directory instead")
    vocab_size: int | None = key(None, f"model.vocab_size: the BPE's size (null: {DEFAULT_VOCAB_SIZE}); with "
                                       "tokenizer=, the most ids it may have (null: any)")
    source: list[str] = key(["shakespeare"], "'shakespeare', or data.path: text files, directories or globs, a "
                                             "prepared dataset; several only with out=")
    tokenizer: str | None = key(None, "data.tokenizer: a tokenizers tokenizer.json to use instead of training a BPE")
    workers: int = key(1, "processes tokenising input files at once")
    on_error: str = key("stop", "an unreadable or undecodable input file stops the preparation, or is skipped",
                        choices=ON_ERROR)


def main(argv: list[str] | None = None) -> int:
    args = parse(Args, __doc__, argv)
    vocab_size = args.vocab_size
    if vocab_size is None and args.tokenizer is None:
        vocab_size = DEFAULT_VOCAB_SIZE
    try:
        options = PrepareOptions(args.workers, args.on_error)
        if args.out is not None:
            if args.cache_dir is not None:
                raise DataError("out= and cache_dir= exclude each other: out= prepares into exactly that directory")
            if "shakespeare" in args.source:
                raise DataError("out= takes text sources; the default corpus (shakespeare) is prepared into "
                                "cache_dir under the name the trainer looks for")
            prepared = prepare_text_corpus(args.source, Path(args.out), vocab_size, args.tokenizer, options)
        elif len(args.source) > 1:
            raise DataError(f"source= names {len(args.source)} sources; without out= it takes one (data.path), "
                            "with out=DIR several become one dataset")
        else:
            source = None if args.source[0] == "shakespeare" else args.source[0]
            cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
            prepared = resolve_dataset(source, cache_dir, vocab_size, args.tokenizer, options)
    except (DataError, FileNotFoundError) as e:  # DataError covers DataPreparationError and DatasetCorruptError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(prepared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
