"""(f) Compiled decode: baseline, Block and Full at model=s prefill a prompt with their inference caches
(KDA state, MLA compressed KV) and decode greedily, eager and then with the one-token step compiled as
`inference.generate compile=true` runs it (model.generation.decode_step). The compiled tokens must be the
eager ones; the figures are ms per decoded token and each variant's ratio to the baseline
(scripts.bench inference's rounds: variants interleaved, the first round warms up and compiles).

    python -m scripts.gpu_checks.decode out=DIR [rehearse=true]    (rehearsal: model=xs, eager only, on the CPU)
"""
from __future__ import annotations

import torch

from model import build_model
from model.generation import decode_step
from scripts.bench.inference import VARIANTS, time_rounds
from scripts.gpu_checks.result import Result, parse_args
from trainer.config import load_config

# (model size, prompt tokens, decoded tokens, timed rounds)
SETTINGS = {"gpu": ("s", 512, 32, 3), "rehearse": ("xs", 16, 4, 1)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    result = Result("compiled_decode")
    size, prompt, decode, rounds = SETTINGS["rehearse" if args.rehearse else "gpu"]
    models = {v: build_model(load_config([f"model={size}", f"variant={v}"]), seed=0).to(args.device).eval()
              for v in VARIANTS}
    vocab = models["baseline"].cfg.vocab_size
    tokens = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0)).to(args.device)
    timed = {"eager": time_rounds(models, tokens, decode, rounds, models, models)}
    if args.rehearse:
        result.skip("compiled decode step on CUDA: tokens equal eager's, ms per token and ratios to the baseline")
    else:
        # A fresh dynamo cache: shapes seen by an earlier compile would make the decode step's dynamic.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(models))
        torch._dynamo.reset()
        timed["compiled"] = time_rounds(models, tokens, decode, rounds, models,
                                        {v: decode_step(m, True) for v, m in models.items()})
        differ = [v for v in VARIANTS if timed["compiled"][v].tokens != timed["eager"][v].tokens]
        if differ:
            result.problems.append(f"compiled greedy tokens differ from eager for {', '.join(differ)}")
    for mode, times in timed.items():
        base = times["baseline"].decode_s
        result.figures[mode] = {v: {"decode_ms_per_token": t.decode_s * 1e3, "ratio_to_baseline": t.decode_s / base,
                                    "prefill_ms": t.prefill_s * 1e3} for v, t in times.items()}
        print(f"  {mode}: " + ", ".join(f"{v} {t.decode_s * 1e3:.2f} ms/token" for v, t in times.items()))
    mode = "compiled" if "compiled" in timed else "eager"
    figures = result.figures[mode]
    result.finish(args.out, f"model={size} {mode} baseline={figures['baseline']['decode_ms_per_token']:.2f}ms/token "
                            f"block={figures['block']['ratio_to_baseline']:.3f}x full={figures['full']['ratio_to_baseline']:.3f}x")


if __name__ == "__main__":
    main()
