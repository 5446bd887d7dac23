"""Inference latency and block storage of baseline vs Block vs Full, in one run.

Prefill latency (whole prompt) and per-token decode latency with the KDA state and MLA compressed KV
caches, interleaved across variants, as ratios to the baseline; with compile=true also both compiled
(torch.compile of the whole model: prefill at the prompt's length, and the one-token decode step as
`inference.generate compile=true` runs it), as ratios to the compiled baseline. Then the block
representations held during prefill (measured from the depth state) against the formula
N * T * d * bytes, unchunked and with chunked prefill, and the formula at the paper's 128K-token sizes.

    python -m scripts.bench inference [model=s] [prompt=512] [decode=32] [rounds=3] [compile=true]

The first round of each mode warms up (and compiles); medians are over the other rounds.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from model.generation import decode_step
from model.residual import DepthGeometry
from scripts.bench.common import bench_model, random_tokens
from scripts.cli import key, parse

VARIANTS = ("baseline", "block", "full")


@dataclass
class Args:
    model: str = key("s", "configs/model/ size")
    prompt: int = key(512, "prompt tokens prefilled")
    decode: int = key(32, "tokens decoded after the prompt")
    rounds: int = key(3, "timed rounds after the warm-up round, variants interleaved")
    chunk: int = key(128, "prefill chunk for the storage measurement")
    compile: bool = key(False, "also time prefill and decode under torch.compile")
    device: str = key("cpu", "where to run (cuda times with a synchronize around calls)", choices=("cpu", "cuda"))
    summary: bool = key(False, "end with one PASS/FAIL line (compiled greedy tokens equal eager's) and the ratios")


def block_storage_bytes(model, tokens: torch.Tensor, chunk: int) -> int:
    """Peak bytes of block representations (and partial sum) held while prefilling in `chunk`-token pieces."""
    cache = model.new_inference_cache(tokens.shape[0], tokens.device, torch.float32)
    peak = 0
    with torch.no_grad():
        for start in range(0, tokens.shape[1], chunk):
            state = model.mixer.start(model.embed(tokens[:, start:start + chunk]))
            state = model.forward_layers(state, cache)  # blocks only grow along depth: the end is the peak
            held = list(state.blocks) + ([state.partial] if state.partial is not None else [])
            peak = max(peak, sum(t.numel() * t.element_size() for t in held))
    return peak


class Timing(NamedTuple):
    prefill_s: float         # median seconds for the whole prompt
    decode_s: float          # median seconds per decoded token (nan: not measured)
    tokens: list[int]        # the greedy tokens of the last round


def time_rounds(models: dict, tokens: torch.Tensor, decode: int, rounds: int, prefill_calls: dict,
                step_calls: dict | None) -> dict[str, Timing]:
    """variant -> Timing, variants interleaved in each round. prefill_calls / step_calls: variant -> the
    callable to time (the model, or it compiled); no step_calls: prefill only."""
    def now() -> float:
        if tokens.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    prefill_times = {v: [] for v in models}
    decode_times = {v: [] for v in models}
    decoded = {v: [] for v in models}
    with torch.no_grad():
        for _ in range(rounds + 1):  # the first round warms up (and compiles)
            for variant, model in models.items():
                cache = model.new_inference_cache(1, tokens.device, torch.float32)
                start = now()
                logits = prefill_calls[variant](tokens, cache=cache)
                prefill_times[variant].append(now() - start)
                if step_calls is None:
                    continue
                token = logits[:, -1].argmax(-1, keepdim=True)
                decoded[variant] = []
                start = now()
                for _ in range(decode):
                    token = step_calls[variant](token, cache=cache)[:, -1].argmax(-1, keepdim=True)
                    decoded[variant].append(token)
                decode_times[variant].append((now() - start) / decode)
    return {v: Timing(statistics.median(prefill_times[v][1:]),
                      statistics.median(decode_times[v][1:]) if decode_times[v] else float("nan"),
                      torch.cat(decoded[v], dim=1)[0].tolist() if decoded[v] else []) for v in models}


def compiled_rounds(models: dict, tokens: torch.Tensor, decode: int, rounds: int) -> dict[str, Timing]:
    """Compiled prefill and compiled decode, each from a fresh dynamo cache: a graph compiled for the
    prompt's length would otherwise turn the decode step's shapes dynamic, and the other way round.
    Decode follows an eager prefill, as in model.generation.generate(compile=True)."""
    # Every variant's graphs hang off the same Decoder.forward: room for a static and a dynamic one each.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(models))
    torch._dynamo.reset()
    prefills = time_rounds(models, tokens, decode, rounds, {v: torch.compile(m) for v, m in models.items()}, None)
    torch._dynamo.reset()
    decodes = time_rounds(models, tokens, decode, rounds, models, {v: decode_step(m, True) for v, m in models.items()})
    return {v: decodes[v]._replace(prefill_s=prefills[v].prefill_s) for v in models}


def print_rows(mode: str, times: dict[str, Timing]) -> None:
    base = times["baseline"]
    for variant, t in times.items():
        print(f"{variant:<10}{mode:<10}{t.prefill_s * 1e3:>14.1f}{t.prefill_s / base.prefill_s:>8.3f}"
              f"{t.decode_s * 1e3:>20.2f}{t.decode_s / base.decode_s:>8.3f}")


def summary_line(timed: dict[str, dict[str, Timing]]) -> str:
    """For scripts/gpu_check.sh: FAIL when a compiled decode's greedy tokens differ from eager's; the
    compiled ratios to the compiled baseline (or the eager ones without compile=true) as figures."""
    mode = "compiled" if "compiled" in timed else "eager"
    times = timed[mode]
    mismatched = [v for v in times if mode == "compiled" and times[v].tokens != timed["eager"][v].tokens]
    figures = " ".join(f"{v}_prefill={times[v].prefill_s / times['baseline'].prefill_s:.3f}x "
                       f"{v}_decode={times[v].decode_s / times['baseline'].decode_s:.3f}x"
                       for v in times if v != "baseline")
    verdict = f"FAIL {mode}_decode tokens differ from eager for {','.join(mismatched)};" if mismatched else \
        f"PASS {mode}_decode"
    return f"{verdict} {figures} baseline_decode={times['baseline'].decode_s * 1e3:.2f}ms"


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    device = torch.device(args.device)
    models = {v: bench_model(args.model, f"variant={v}").to(device).eval() for v in VARIANTS}
    cfg = models["block"].cfg
    tokens = random_tokens(cfg.vocab_size, (1, args.prompt)).to(device)
    timed = {"eager": time_rounds(models, tokens, args.decode, args.rounds, models, models)}
    if args.compile:
        timed["compiled"] = compiled_rounds(models, tokens, args.decode, args.rounds)
    print(f"model={args.model} prompt={args.prompt} decode={args.decode} rounds={args.rounds} "
          f"threads={torch.get_num_threads()} block_size={DepthGeometry.of(cfg).size} device={device}")
    print(f"{'variant':<10}{'mode':<10}{'prefill (ms)':>14}{'ratio':>8}{'decode (ms/token)':>20}{'ratio':>8}")
    for mode, times in timed.items():
        print_rows(mode, times)

    print("\nblock storage during prefill (fp32), measured vs N * T * d * 4 (N: blocks incl. the embedding):")
    for variant in ("block", "full"):
        model = models[variant]
        n_blocks = model.mixer.geometry.max_sources
        for chunk in (args.prompt, args.chunk):
            measured = block_storage_bytes(model, tokens, chunk)
            formula = n_blocks * min(chunk, args.prompt) * cfg.d_model * 4
            print(f"  {variant:<6} chunk={chunk:<6} measured {measured / 2**20:8.2f} MiB   formula "
                  f"{formula / 2**20:8.2f} MiB")
    print("\nformula at the paper's sizes (128K tokens, N=8, d=4096, bf16):")
    full = 8 * 131072 * 4096 * 2
    print(f"  unsharded {full / 1e9:.1f} GB; tp=8 sequence-sharded {full / 8 / 1e9:.2f} GB per device; "
          f"tp=8 with 16K-token chunks {8 * 16384 * 4096 * 2 / 8 / 1e9:.2f} GB per device")
    if args.summary:
        line = summary_line(timed)
        print(line)
        sys.exit(line.startswith("FAIL"))

