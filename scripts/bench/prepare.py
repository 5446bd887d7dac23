"""Preparation throughput with 1..N worker processes on a multi-file corpus.

    python -m scripts.bench prepare source=DIR_OR_GLOB tokenizer=tokenizer.json [workers=[1,2]] [repeats=3]

Each run prepares the same inputs with the same tokenizer (no BPE training, so only reading, tokenising and
writing shards is timed) into a fresh temporary directory, and prints MB/s and tokens/s per worker count,
with the spread over repeats and the speed-up over one worker measured in the same invocation.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.cli import fail, key, parse
from trainer.data import PrepareOptions, prepare_text_corpus
from trainer.data.format import read_manifest
from trainer.data.text_inputs import list_text_inputs


@dataclass
class Args:
    source: str | None = key(None, "the inputs: a directory or glob of text files (required)")
    tokenizer: str | None = key(None, "a tokenizers tokenizer.json (required; no BPE is trained)")
    workers: list[int] = key([1, 2], "worker-process counts to time")
    repeats: int = key(3, "runs per worker count")


def one_run(source: str, tokenizer: str, workers: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as scratch:
        start = time.perf_counter()
        out = prepare_text_corpus([source], Path(scratch) / "out", None, tokenizer, PrepareOptions(workers=workers))
        return time.perf_counter() - start, read_manifest(out)["tokens"]


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    if not args.source or not args.tokenizer:
        fail("source= and tokenizer= are required, e.g. source=corpus/ tokenizer=corpus/tokenizer.json")
    files = list_text_inputs([args.source])
    megabytes = sum(path.stat().st_size for path in files) / 1e6
    print(f"{len(files)} files, {megabytes:.1f} MB")
    rates = {}
    for workers in args.workers:
        runs = [one_run(args.source, args.tokenizer, workers) for _ in range(args.repeats)]
        seconds = [s for s, _ in runs]
        rates[workers] = [megabytes / s for s in seconds]
        print(f"workers={workers}: {statistics.median(rates[workers]):.2f} MB/s (min {min(rates[workers]):.2f}, "
              f"max {max(rates[workers]):.2f}), {runs[0][1] / statistics.median(seconds):,.0f} tokens/s, "
              f"median {statistics.median(seconds):.1f}s")
    base = statistics.median(rates[min(rates)])
    for workers, rate in rates.items():
        print(f"speed-up with {workers} workers: {statistics.median(rate) / base:.2f}x")

