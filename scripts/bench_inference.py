"""Inference latency and block storage of baseline vs Block vs Full, in one run.

Prefill latency (whole prompt) and per-token decode latency with the KDA state and MLA compressed KV
caches, interleaved across variants, as ratios to the baseline; then the block representations held
during prefill (measured from the depth state) against the formula N * T * d * bytes, unchunked and
with chunked prefill, and the formula at the paper's 128K-token sizes.

    python -m scripts.bench_inference [--model s] [--prompt 512] [--decode 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from model import build_model
from model.generation import prefill
from trainer.config import load_config

VARIANTS = ("baseline", "block", "full")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="s")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk for the storage measurement")
    args = parser.parse_args()
    models = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        models[variant] = build_model(load_config([f"model={args.model}", f"variant={variant}"])).eval()
    cfg = models["block"].cfg
    tokens = torch.randint(0, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    prefill_times = {v: [] for v in VARIANTS}
    decode_times = {v: [] for v in VARIANTS}
    with torch.no_grad():
        for _ in range(args.rounds + 1):  # the first round warms up
            for variant, model in models.items():
                cache = model.new_inference_cache(1, tokens.device, torch.float32)
                start = time.perf_counter()
                logits = prefill(model, tokens, cache)
                prefill_times[variant].append(time.perf_counter() - start)
                token = logits[:, -1].argmax(-1, keepdim=True)
                start = time.perf_counter()
                for _ in range(args.decode):
                    token = model(token, cache=cache)[:, -1].argmax(-1, keepdim=True)
                decode_times[variant].append((time.perf_counter() - start) / args.decode)
    print(f"model={args.model} prompt={args.prompt} decode={args.decode} rounds={args.rounds} "
          f"threads={torch.get_num_threads()} block_size={cfg.block_size}")
    base_p, base_d = (statistics.median(t["baseline"][1:]) for t in (prefill_times, decode_times))
    print(f"{'variant':<10}{'prefill (ms)':>14}{'ratio':>8}{'decode (ms/token)':>20}{'ratio':>8}")
    for variant in VARIANTS:
        p, d = statistics.median(prefill_times[variant][1:]), statistics.median(decode_times[variant][1:])
        print(f"{variant:<10}{p * 1e3:>14.1f}{p / base_p:>8.3f}{d * 1e3:>20.2f}{d / base_d:>8.3f}")

    print("\nblock storage during prefill (fp32), measured vs N * T * d * 4 (N: blocks incl. the embedding):")
    for variant in ("block", "full"):
        model = models[variant]
        n_blocks = 1 + -(-cfg.n_sublayers // model.mixer.block_size)
        for chunk in (args.prompt, args.chunk):
            measured = block_storage_bytes(model, tokens, chunk)
            formula = n_blocks * min(chunk, args.prompt) * cfg.d_model * 4
            print(f"  {variant:<6} chunk={chunk:<6} measured {measured / 2**20:8.2f} MiB   formula "
                  f"{formula / 2**20:8.2f} MiB")
    print("\nformula at the paper's sizes (128K tokens, N=8, d=4096, bf16):")
    full = 8 * 131072 * 4096 * 2
    print(f"  unsharded {full / 1e9:.1f} GB; tp=8 sequence-sharded {full / 8 / 1e9:.2f} GB per device; "
          f"tp=8 with 16K-token chunks {8 * 16384 * 4096 * 2 / 8 / 1e9:.2f} GB per device")


if __name__ == "__main__":
    main()
