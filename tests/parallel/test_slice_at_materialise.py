"""Under tp/ep a model built on the meta device is sliced before any weight exists
(parallel.parallelize.materialise_and_shard): each rank's slices are exactly one process's initial
weights, and the host never holds the whole model on the way."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import build_model
from model.init import materialise
from parallel.dims import DistInfo, Layout
from parallel.parallelize import materialise_and_shard
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
ONE_PROCESS = DistInfo(0, 1, 0, torch.device("cpu"), None)
SEED = 3


def _layout(tp_rank: int, ep_rank: int) -> Layout:
    # Slicing needs only each rank's coordinates; no process group is touched before a forward.
    return Layout(tp=2, ep=2, tp_rank=tp_rank, ep_rank=ep_rank)


@pytest.mark.parametrize("tp_rank,ep_rank", [(0, 1), (1, 0)])
def test_each_ranks_slices_are_one_process_initial_weights(tp_rank, ep_rank):
    cfg = load_config(["model=xs", "variant=block"])
    whole = build_model(cfg, device="meta")
    materialise(whole, "cpu", whole.cfg.init_stds, SEED)
    whole_params = dict(whole.named_parameters())
    model = build_model(cfg, device="meta")
    layout = _layout(tp_rank, ep_rank)
    shards = materialise_and_shard(model, ONE_PROCESS, layout, SEED)

    assert {kind for _, kind in shards.dims.values()} == {"tp", "ep"}
    for name, param in model.named_parameters():
        expected = shards.local_slice(name, whole_params[name].detach(), layout)
        assert not param.is_meta and param.shape == expected.shape, name
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=0, msg=name)
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, dict(whole.named_buffers())[name], rtol=0, atol=0, msg=name)


PEAK_SCRIPT = """
import json, resource, sys, torch
from model import build_model
from model.init import materialise
from parallel.dims import DistInfo, Layout
from parallel.parallelize import materialise_and_shard
from trainer.config import load_config

one_process, layout = DistInfo(0, 1, 0, torch.device("cpu"), None), Layout(tp=2, ep=8)
# A small model first, the same way: first-use costs (lazy imports, allocator arenas) land before the measurement.
materialise_and_shard(build_model(load_config(["model=xs", "variant=block"]), device="meta"), one_process,
                      Layout(tp=2, ep=2), 0)
model = build_model(load_config(["model=s", "variant=block"]), device="meta")
full = 4 * sum(p.numel() for p in model.parameters())
rss_before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
if sys.argv[1] == "sliced":
    materialise_and_shard(model, one_process, layout, 0)
else:  # what every tp/ep rank did before: build the whole model on the host
    materialise(model, "cpu", model.cfg.init_stds, 0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kept = 4 * sum(p.numel() for p in model.parameters())
print(json.dumps({"full": full, "kept": kept, "growth": peak - rss_before}))
"""


def _peak(mode: str) -> dict:
    # A clean environment: variables other tests in this worker set (the Triton interpreter) stay out.
    env = {"PATH": os.environ.get("PATH", ""), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, mode], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_host_never_holds_the_whole_model_while_slicing():
    """Peak RSS growth while materialising model=s (79 MB of fp32) as one rank of tp=2 x ep=8: this
    rank's slices (35 MB) plus one init unit (<= 8.4 MB, and its init temporaries) at a time, against
    building the whole model on the host as the code before did (measured 50 MB against 85 MB, with the
    slices cut from it after that). glibc is told to mmap large blocks, so a freed unit leaves the RSS."""
    sliced, whole = _peak("sliced"), _peak("whole")
    assert sliced["kept"] < 0.5 * sliced["full"] and whole["growth"] >= 0.9 * whole["full"], (sliced, whole)
    assert sliced["growth"] < whole["growth"] - 0.25 * whole["full"], (sliced, whole)
