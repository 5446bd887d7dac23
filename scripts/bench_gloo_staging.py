"""Host memory gloo's all-gather and reduce-scatter take beyond their tensors (FSDP2's collectives on CPU).

parallel/memory_plan.py's CPU plan for FSDP counts one staging copy per collective; this measures it.
Two ranks; each collective runs in a fresh process (ru_maxrss is a per-process high-water mark), with
MALLOC_MMAP_THRESHOLD_ fixed so freed blocks leave the RSS. `extra` = peak RSS during the call minus the
RSS before it, with input and output already allocated and touched.

    python -m scripts.bench_gloo_staging [--mib 160]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor")


def measure(collective: str, mib: int) -> None:
    """Run under torchrun: one collective whose large side (all-gather output, reduce-scatter input) is `mib`."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    numel = mib * 2**20 // 4
    large = torch.ones(numel)
    small = torch.ones(numel // dist.get_world_size())
    with open("/proc/self/statm") as statm:
        before = int(statm.read().split()[1]) * resource.getpagesize()
    if collective == "all_gather_into_tensor":
        dist.all_gather_into_tensor(large, small)
    else:
        dist.reduce_scatter_tensor(small, large)
    extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if dist.get_rank() == 0:
        print(json.dumps({"collective": collective, "mib": mib, "extra_mib": extra / 2**20}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=160, help="size of the collective's large side")
    parser.add_argument("--one", choices=COLLECTIVES, help=argparse.SUPPRESS)  # the torchrun worker
    args = parser.parse_args()
    if args.one:
        measure(args.one, args.mib)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    print(f"gloo, 2 ranks, large side {args.mib} MiB fp32")
    for collective in COLLECTIVES:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               "-m", "scripts.bench_gloo_staging", "--one", collective, "--mib", str(args.mib)],
                              capture_output=True, text=True, env=env)
        if done.returncode:
            sys.exit(f"{collective} failed: {done.stderr.strip().splitlines()[-1]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{collective:24s} extra peak {result['extra_mib']:7.1f} MiB ({result['extra_mib'] / args.mib:.2f}x the large side)")


if __name__ == "__main__":
    main()
