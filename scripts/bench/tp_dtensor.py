"""Tensor parallelism by hand vs on DTensor: one dense SwiGLU region, forward + backward, tp ranks on gloo.

Ours (parallel/tensor.py): plain-tensor slices of the weights, the input all-gathered along the sequence and
the output reduce-scattered by hooks around the module. DTensor (torchtitan's plan): `parallelize_module`
with PrepareModuleInput (sequence-sharded -> replicated, kept a DTensor so the two column-parallel inputs'
gradients meet as one partial sum), ColwiseParallel gate/up and RowwiseParallel down back to sequence shards.
Both start from the same weights; the script checks that outputs and every gradient agree, then times
forward + backward (median [min, max] of `repeats` rounds of `iters` calls, the two interleaved) at a long
sequence (compute-bound) and a short one (dispatch-bound: DTensor's per-op sharding propagation shows).

    torchrun --nproc-per-node 2 -m scripts.bench tp_dtensor [model=s] [seq=[2048,64]] [iters=20] [repeats=3]
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

from model.mlp import GatedMLP
from parallel.dims import Degrees, build_layout, init_distributed
from parallel.tensor import _region, _shard, local_sequence  # the hand-written region itself
from scripts.bench.common import interleaved, seconds, spread
from scripts.cli import key, parse
from trainer.config import load_config


@dataclass
class Args:
    model: str = key("s", "configs/model/ size: its d_model and dense_inter")
    seq: list[int] = key([2048, 64], "sequence lengths (a long, compute-bound one; a short, dispatch-bound one)")
    iters: int = key(20, "calls per timed round")
    repeats: int = key(3, "timed rounds, ours and DTensor interleaved")


def dtensor_swiglu(mlp: GatedMLP, mesh) -> GatedMLP:
    return parallelize_module(mlp, mesh, {
        "": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "gate_proj": ColwiseParallel(),
        "up_proj": ColwiseParallel(),
        "down_proj": RowwiseParallel(output_layouts=Shard(1)),
    })


def step(mlp: GatedMLP, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    out = mlp(x)
    out.backward(grad)
    return x.grad


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    info = init_distributed()
    tp = info.world_size
    layout = build_layout(info, Degrees(tp=tp))
    cfg = load_config([f"model={args.model}"]).model
    torch.manual_seed(0)
    whole = GatedMLP(cfg.d_model, cfg.dense_inter)
    ours, theirs = GatedMLP(cfg.d_model, cfg.dense_inter), GatedMLP(cfg.d_model, cfg.dense_inter)
    ours.load_state_dict(whole.state_dict())
    theirs.load_state_dict(whole.state_dict())
    _shard(ours, "", layout.tp_rank, tp)
    _region(ours, layout.tp_group)
    dtensor_swiglu(theirs, layout.mesh["tp"])

    rows = []
    for seq in args.seq:
        generator = torch.Generator().manual_seed(seq)
        x = local_sequence(torch.randn(2, seq, cfg.d_model, generator=generator), layout)  # (B, T/tp, d)
        grad = local_sequence(torch.randn(2, seq, cfg.d_model, generator=generator), layout)
        for mlp in (ours, theirs):
            mlp.zero_grad(set_to_none=True)
        x_grads = step(ours, x, grad), step(theirs, x, grad)
        errors = [(x_grads[0] - x_grads[1]).abs().max().item()]
        errors += [(a.grad - local(b.grad)).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters())]

        def ms_per_call(mlp: GatedMLP) -> float:
            dist.barrier()
            return seconds(lambda: [step(mlp, x, grad) for _ in range(args.iters)]) / args.iters * 1e3

        times = interleaved({"ours": lambda: ms_per_call(ours), "dtensor": lambda: ms_per_call(theirs)}, args.repeats,
                            warmup=0)
        rows.append((seq, max(errors), times))
    if info.is_main:
        print(f"model={args.model} SwiGLU {cfg.d_model} -> {cfg.dense_inter}, batch 2, tp={tp} (gloo, CPU), "
              f"forward + backward in ms: median [min, max] of {args.repeats} rounds of {args.iters}")
        print(f"{'seq':>6} {'ours ms':>22} {'DTensor ms':>22} {'DTensor / ours':>15} {'max |diff|':>11}")
        for seq, error, times in rows:
            ratio = statistics.median(times["dtensor"]) / statistics.median(times["ours"])
            print(f"{seq:>6} {spread(times['ours'], 3):>22} {spread(times['dtensor'], 3):>22} {ratio:>15.2f} "
                  f"{error:>11.1e}")
    dist.destroy_process_group()

