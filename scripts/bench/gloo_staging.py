"""Host memory gloo's all-gather and reduce-scatter take beyond their tensors (FSDP2's collectives on CPU).

parallel/memory_plan.py's CPU plan for FSDP counts one staging copy per collective; this measures it.
Two ranks; each collective runs in a fresh process (ru_maxrss is a per-process high-water mark), with
MALLOC_MMAP_THRESHOLD_ fixed so freed blocks leave the RSS. `extra` = peak RSS during the call minus the
RSS before it, with input and output already allocated and touched.

    python -m scripts.bench gloo_staging [mib=160]
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from scripts.bench.common import in_fresh_process, peak_rss_bytes, rss_bytes
from scripts.cli import key, parse

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor")


@dataclass
class Args:
    mib: int = key(160, "size of the collective's large side")
    one: str | None = key(None, "internal: run this collective as one rank of a launch", choices=(None, *COLLECTIVES))


def measure(collective: str, mib: int) -> None:
    """Run under torchrun: one collective whose large side (all-gather output, reduce-scatter input) is `mib`."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    numel = mib * 2**20 // 4
    large = torch.ones(numel)
    small = torch.ones(numel // dist.get_world_size())
    before = rss_bytes()
    if collective == "all_gather_into_tensor":
        dist.all_gather_into_tensor(large, small)
    else:
        dist.reduce_scatter_tensor(small, large)
    extra = peak_rss_bytes() - before
    if dist.get_rank() == 0:
        print(json.dumps({"collective": collective, "mib": mib, "extra_mib": extra / 2**20}))
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    args = parse(Args, __doc__, argv)
    if args.one:
        measure(args.one, args.mib)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    print(f"gloo, 2 ranks, large side {args.mib} MiB fp32")
    for collective in COLLECTIVES:
        result = in_fresh_process(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                                   "scripts.bench", "gloo_staging", f"one={collective}", f"mib={args.mib}"],
                                  env, collective)
        print(f"{collective:24s} extra peak {result['extra_mib']:7.1f} MiB ({result['extra_mib'] / args.mib:.2f}x the large side)")
