"""Forward+backward step time of baseline vs Full vs Block AttnRes in one process.

Variants are interleaved round by round so drift in machine load hits all of them alike. Each round
gives every variant a ratio to the baseline's step of the same round; the median of those paired ratios
is reported with their range over rounds, beside the median step time. compile=true compiles every
variant's blocks as train.compile=true does (parallel/compile.py), so the ratios compare compiled to
compiled; the warm-up rounds then include the compile, the timed rounds do not.

`block` is Block AttnRes as configured by default, whose read depends on the device (variant.two_phase=null:
the batched two-phase read where its fused kernels run, the per-layer read elsewhere); `block-two-phase`
and `block-per-layer-read` force one read.

    python -m scripts.bench step [model=s] [batch=4] [seq=256] [rounds=8] [compile=true]
                                 [variants=[baseline,block]] [document_length=64]

document_length=L also times every variant with document masking (data.document_masking=true): an
end-of-text token every L tokens on average (uniform gaps in [1, 2L - 1]), its ratio to the same
variant unmasked in the last column.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from model.document_masking import document_starts
from parallel.compile import apply_compile
from scripts.bench.common import bench_model, interleaved, set_threads
from scripts.cli import fail, key, parse

CASES = {
    "baseline": ["variant=baseline"],
    "full": ["variant=full"],
    "block": ["variant=block"],
    "block-two-phase": ["variant=block", "variant.two_phase=true"],
    "block-per-layer-read": ["variant=block", "variant.two_phase=false"],
}


@dataclass
class Args:
    model: str = key("s", "configs/model/ size")
    batch: int = key(4, "sequences per step")
    seq: int = key(256, "tokens per sequence")
    rounds: int = key(8, "timed rounds, every variant once per round")
    warmup: int = key(0, "untimed rounds first (0: 1 eager, 3 compiled: steps run slower for a few seconds after "
                         "a cold compile, and MoE expert sizes recompile once with dynamic shapes)")
    threads: int = key(0, "torch threads (0: leave as is)")
    compile: bool = key(False, "torch.compile each block (train.compile=true)")
    document_length: int = key(0, "also time document masking at this mean document length in tokens (0: do not)")
    variants: list[str] = key(list(CASES), "the variants to time (the baseline is always timed)", choices=tuple(CASES))


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    if args.document_length < 0:
        fail(f"document_length={args.document_length} must be >= 0 (0: no document masking)")
    variants = ["baseline"] + [v for v in args.variants if v != "baseline"]
    set_threads(args.threads)

    models = {}
    for name in variants:
        models[name] = bench_model(args.model, *CASES[name])
        if args.compile:
            apply_compile(models[name])
    vocab = models["baseline"].cfg.vocab_size
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab, (args.batch, args.seq), generator=generator)
    cases = {name: (model, None) for name, model in models.items()}
    if args.document_length:
        eot = 0  # a stand-in end-of-text id: drawn tokens are >= 1
        gaps = torch.randint(1, 2 * args.document_length, (args.batch, args.seq), generator=generator)
        ends = gaps.cumsum(dim=1)  # (B, n) positions of document ends, of which those < seq are used
        for row in range(args.batch):
            tokens[row, ends[row][ends[row] < args.seq]] = eot
        starts = document_starts(tokens, eot)
        cases.update({f"{name} masked": (model, starts) for name, model in models.items()})

    def step(model, starts) -> float:
        start = time.perf_counter()
        logits = model(tokens, document_starts=starts)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    times = interleaved({name: lambda case=case: step(*case) for name, case in cases.items()}, args.rounds,
                        warmup=args.warmup or (3 if args.compile else 1))

    medians = {name: statistics.median(samples) for name, samples in times.items()}
    ratios = {name: [t / base for t, base in zip(samples, times["baseline"])] for name, samples in times.items()}
    masked_ratios = {name: [t / unmasked for t, unmasked in zip(samples, times[name.removesuffix(" masked")])]
                     for name, samples in times.items() if name.endswith(" masked")}
    print(f"model={args.model} batch={args.batch} seq={args.seq} rounds={args.rounds} "
          f"threads={torch.get_num_threads()} torch={torch.__version__} compile={args.compile}"
          + (f" document_length={args.document_length}" if args.document_length else ""))
    if "block" in models:
        mixer = models["block"].mixer
        batched = mixer.batches(mixer.start(models["block"].embed(tokens)))
        print(f"block (variant.two_phase=null) reads {'two-phase' if batched else 'per layer'} here")
    print(f"{'variant':<28}{'step (ms)':>12}{'ratio':>8}{'range':>15}"
          + (f"{'vs unmasked':>13}" if args.document_length else ""))
    for name, median in medians.items():
        versus = f"{statistics.median(masked_ratios[name]):>13.3f}" if name in masked_ratios else ""
        spread = f"{min(ratios[name]):.3f}-{max(ratios[name]):.3f}"
        print(f"{name:<28}{median * 1e3:>12.1f}{statistics.median(ratios[name]):>8.3f}{spread:>15}{versus}")

