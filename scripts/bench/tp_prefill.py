"""Block storage per rank during prefill under tensor + sequence parallelism, against the formula.

Each rank prefills its T/tp slice of the prompt (whole, then in chunks) with the KDA/MLA caches and
the depth state sharded along the sequence; it reports the bytes of block representations it holds
against N * T/tp * d * bytes, and the largest logit difference to an unsharded prefill in one process.

    torchrun --nproc-per-node 2 -m scripts.bench tp_prefill [model=s] [variant=block] [prompt=512] [chunk=128]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.dims import Degrees, build_layout, init_distributed, shutdown
from parallel.parallelize import slice_model
from parallel.tensor import gather_sequence, local_sequence
from scripts.bench.common import bench_model, random_tokens
from scripts.bench.inference import block_storage_bytes
from scripts.cli import key, parse


@dataclass
class Args:
    model: str = key("s", "configs/model/ size")
    variant: str = key("block", "configs/variant/ residual variant")
    prompt: int = key(512, "prompt tokens prefilled")
    chunk: int = key(128, "tokens per prefill chunk")


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    info = init_distributed()
    tp = info.world_size
    layout = build_layout(info, Degrees(tp=tp))
    reference = bench_model(args.model, f"variant={args.variant}").eval()
    model = bench_model(args.model, f"variant={args.variant}").eval()
    cfg = model.cfg
    slice_model(model, layout)
    tokens = random_tokens(cfg.vocab_size, (1, args.prompt))
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

