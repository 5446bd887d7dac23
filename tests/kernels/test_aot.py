"""Every Triton kernel compiles ahead of time for sm_80 and sm_90a, fp32 and bf16, at every tile
configuration the launchers choose for the model sizes we ship, spills no register and fits an SM's
shared memory.

The compilation runs `python -m scripts.kernel_report` in a child process: the interpreter tests in
this directory set TRITON_INTERPRET=1, under which triton.jit builds functions that cannot be compiled
for a GPU. One child per architecture, so pytest-xdist runs the two side by side.
"""
import kernel_device  # noqa: F401  before triton is first imported: this process's kernels stay interpreted

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernels
from kernels.aot import SHARED_PER_SM
from scripts.kernel_report import ARCHS, DTYPES, tile_configs

# Every kernels/<op>/triton.py: a new kernel module is covered without editing this test.
KERNEL_MODULES = [importlib.import_module(f"kernels.{path.parent.name}.triton")
                  for path in sorted(Path(kernels.__file__).parent.glob("*/triton.py"))]


def entry_points() -> set[str]:
    """The @triton.jit functions of the kernel modules that no other of them calls: what a launcher runs."""
    jitted = {name: obj for module in KERNEL_MODULES for name, obj in vars(module).items()
              if type(obj).__name__ in ("JITFunction", "InterpretedFunction")}
    sources = {name: inspect.getsource(obj.fn) for name, obj in jitted.items()}
    return {name for name in jitted if not any(f"{name}(" in src for other, src in sources.items() if other != name)}


@pytest.mark.slow
def test_the_table_launches_every_entry_point_in_both_dtypes():
    configs = tile_configs()
    assert entry_points() == {"_phase1_fwd", "_phase1_bwd", "_phase2_fwd", "_phase2_bwd", "_rms_norm_fwd", "_rms_norm_bwd"}
    for dtype in DTYPES:
        assert {c.launch.name for c in configs if c.dtype == dtype} == entry_points(), dtype
    # The kimi_linear_48b shape (d 2304, 7 queries per block) takes the GPU tiles, not the interpreter's.
    big = [c for c in configs if c.launch.name == "_phase1_fwd" and "kimi_linear_48b" in c.used_by]
    assert big and all(c.launch.constexprs["BLOCK_D"] == 32 and c.launch.num_warps == 8 for c in big)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_every_tile_configuration_compiles_without_spills(arch, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # (aot compiles anew anyway) keep ~/.triton clean
    records_path = tmp_path / "records.json"
    result = subprocess.run([sys.executable, "-m", "scripts.kernel_report", f"archs={arch}", "roofline=false",
                             f"json={records_path}"], env=env, capture_output=True, text=True, timeout=900)
    assert records_path.exists(), result.stderr[-3000:]
    records = json.loads(records_path.read_text())
    assert len(records) == len(tile_configs()), result.stdout[-3000:]
    assert {r["kernel"] for r in records} == entry_points()
    spilling = [(r["label"], r["spill_stores"], r["spill_loads"]) for r in records if r["spill_stores"] + r["spill_loads"]]
    assert not spilling, spilling
    assert all(0 < r["registers"] <= 255 and r["num_warps"] in (4, 8, 16) for r in records), records
    # A program that asks for more shared memory than an SM has does not launch at all.
    too_big = [(r["label"], r["shared"]) for r in records if r["shared"] > SHARED_PER_SM[arch]]
    assert not too_big, too_big
    assert result.returncode == 0, result.stderr[-3000:]
