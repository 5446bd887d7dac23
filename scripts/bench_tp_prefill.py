"""Block storage per rank during prefill under tensor + sequence parallelism, against the formula.

Each rank prefills its T/tp slice of the prompt (whole, then in chunks) with the KDA/MLA caches and
the depth state sharded along the sequence; it reports the bytes of block representations it holds
against N * T/tp * d * bytes, and the largest logit difference to an unsharded prefill in one process.

    torchrun --nproc-per-node 2 -m scripts.bench_tp_prefill [--model s] [--prompt 512] [--chunk 128]
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from model import build_model
from parallel.dims import Degrees, build_layout, init_distributed, shutdown
from parallel.parallelize import slice_model
from parallel.tensor import gather_sequence, local_sequence
from scripts.bench_inference import block_storage_bytes
from trainer.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="s")
    parser.add_argument("--variant", default="block")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    args = parser.parse_args()
    info = init_distributed()
    tp = info.world_size
    layout = build_layout(info, Degrees(tp=tp))
    config = load_config([f"model={args.model}", f"variant={args.variant}"])
    cfg = config.model
    torch.manual_seed(0)
    reference = build_model(config).eval()
    torch.manual_seed(0)
    model = build_model(config).eval()
    slice_model(model, layout)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    n_sources = model.mixer.geometry.max_sources

    rows = []
    for chunk in (args.prompt, args.chunk):
        # A chunk of C tokens is split over the ranks: each holds C/tp tokens of every block.
        local_chunks = [local_sequence(tokens[:, s:s + chunk], layout) for s in range(0, args.prompt, chunk)]
        measured = block_storage_bytes(model, torch.cat(local_chunks, dim=1), chunk // tp)
        formula = n_sources * chunk // tp * cfg.d_model * 4
        rows.append((chunk, measured, formula))

    with torch.no_grad():
        cache = model.new_inference_cache(1, tokens.device, torch.float32)
        for start in range(0, args.prompt, args.chunk):
            local_logits = model(local_sequence(tokens[:, start:start + args.chunk], layout), cache=cache)
        logits = gather_sequence(local_logits, layout.tp_group)
        expected_cache = reference.new_inference_cache(1, tokens.device, torch.float32)
        for start in range(0, args.prompt, args.chunk):
            expected = reference(tokens[:, start:start + args.chunk], cache=expected_cache)
    error = (logits - expected).abs().max().item()

    if info.is_main:
        print(f"model={args.model} variant={args.variant} prompt={args.prompt} tp={tp} "
              f"N={n_sources} sources (blocks incl. the embedding) d={cfg.d_model}, fp32")
        for chunk, measured, formula in rows:
            print(f"  chunk={chunk:<6} per-rank block storage measured {measured / 2**20:7.3f} MiB   "
                  f"formula N*chunk/tp*d*4 {formula / 2**20:7.3f} MiB   unsharded "
                  f"{formula * tp / 2**20:7.3f} MiB")
        print(f"  chunked tp={tp} prefill vs one process: max |logit difference| {error:.2e}")
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
