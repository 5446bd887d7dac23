"""Forward+backward step time of baseline vs Full vs Block AttnRes in one process.

Variants are interleaved round by round so drift in machine load hits all of them alike. Each round
gives every variant a ratio to the baseline's step of the same round; the median of those paired ratios
is reported with their range over rounds, beside the median step time. --compile compiles every
variant's blocks as train.compile=true does (parallel/compile.py), so the ratios compare compiled to
compiled; the warm-up rounds then include the compile, the timed rounds do not.

`block` is Block AttnRes as configured by default, whose read depends on the device (variant.two_phase=null:
the batched two-phase read where its fused kernels run, the per-layer read elsewhere); `block-two-phase`
and `block-per-layer-read` force one read.

    python -m scripts.bench_step [--model s] [--batch 4] [--seq 256] [--rounds 8] [--compile]
                                 [--variants baseline,block] [--document-length 64]

--document-length L also times every variant with document masking (data.document_masking=true): an
end-of-text token every L tokens on average (uniform gaps in [1, 2L - 1]), its ratio to the same
variant unmasked in the last column.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from model import build_model
from model.documents import document_starts
from parallel.compile import apply_compile
from trainer.config import load_config

CASES = {
    "baseline": ["variant=baseline"],
    "full": ["variant=full"],
    "block": ["variant=block"],
    "block-two-phase": ["variant=block", "variant.two_phase=true"],
    "block-per-layer-read": ["variant=block", "variant.two_phase=false"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="s")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed rounds first (0: 1 eager, 3 compiled: steps run slower for a few seconds "
                             "after a cold compile, and MoE expert sizes recompile once with dynamic shapes)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (train.compile=true)")
    parser.add_argument("--document-length", type=int, default=0,
                        help="also time document masking at this mean document length in tokens (0: do not)")
    parser.add_argument("--variants", default=",".join(CASES),
                        help=f"comma-separated subset of {', '.join(CASES)} (the baseline is always timed)")
    args = parser.parse_args()
    variants = ["baseline"] + [v for v in args.variants.split(",") if v != "baseline"]
    unknown = [v for v in variants if v not in CASES]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; valid: {', '.join(CASES)}")
    if args.document_length < 0:
        parser.error(f"--document-length={args.document_length} must be >= 0 (0: no document masking)")
    if args.threads:
        torch.set_num_threads(args.threads)

    models, tokens = {}, None
    for name in variants:
        overrides = CASES[name]
        torch.manual_seed(0)
        models[name] = build_model(load_config([f"model={args.model}", *overrides]))
        if args.compile:
            apply_compile(models[name])
        vocab = models[name].cfg.vocab_size
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

    for _ in range(args.warmup or (3 if args.compile else 1)):
        for model, starts in cases.values():
            step(model, starts)
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (model, starts) in cases.items():
            times[name].append(step(model, starts))

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


if __name__ == "__main__":
    main()
