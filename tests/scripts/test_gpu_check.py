"""scripts/gpu_check.sh without a GPU: the dry run lists every check with its command; a real run
refuses in one line; the PASS/FAIL lines its Python checks end with judge the right figures."""
import json
import math
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

from scripts import bench_inference, bench_kernels
from scripts.gpu_checks import train_steps

REPO = Path(__file__).resolve().parents[2]
CHECKS = ["triton_kernels_cuda", "kernel_report", "bench_kernels", "fla_chunk_kda", "grouped_mm", "train_bf16_m", "compiled_decode"]


def gpu_check(*args):
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)


def test_dry_run_lists_every_check_and_its_command():
    result = gpu_check("--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"gpu_check: {len(CHECKS)} checks, logs under runs/gpu_check/")
    assert [line.split(" ")[0] for line in lines[1:]] == CHECKS
    commands = dict(line.split(": ", 1) for line in lines[1:])
    assert commands["triton_kernels_cuda (limit 240s)"] == (
        f"env -u TRITON_INTERPRET KERNEL_TEST_DEVICE=cuda {sys.executable} -m pytest -q -p no:cacheprovider tests/kernels")
    assert commands["kernel_report (limit 180s)"].endswith("-m scripts.kernel_report --archs 90 --dtypes bf16 --measure")
    assert commands["train_bf16_m (limit 180s)"].endswith("--steps 30")
    assert "--compile --summary" in commands["compiled_decode (limit 240s)"]


def test_without_a_gpu_a_real_run_refuses_in_one_line():
    result = gpu_check()
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"gpu_check: no CUDA device visible to {sys.executable} (torch.cuda.is_available() is "
                             "False); run --dry-run to list the checks\n")
    assert gpu_check("--fast").stderr == "gpu_check: unknown argument '--fast'; the only option is --dry-run\n"


GOALS = Namespace(goal_speedup=1.4, goal_peak_pct=70.0, max_error=2e-2)


def kernel_row(speedup, peak_pct, error):
    return {"speedup_vs_compile": speedup, "peak_pct": peak_pct, "max_rel_error": error}


def test_bench_kernels_summary_needs_every_row_to_meet_every_goal():
    good = kernel_row(1.6, 80.0, 3e-3)
    assert bench_kernels.summary_line([good, kernel_row(1.5, 72.0, 1e-3)], GOALS) == (
        "PASS bench_kernels rows=2 min_vs_compile=1.50x (goal >= 1.4x) min_peak=72% (goal >= 70%) "
        "max_rel_error=3.0e-03 (<= 2e-02)")
    for bad in (kernel_row(1.3, 80.0, 0.0), kernel_row(2.0, 69.0, 0.0), kernel_row(2.0, 90.0, 0.05),
                kernel_row(2.0, math.nan, 0.0)):  # nan: the device's peak is unknown
        assert bench_kernels.summary_line([bad, good], GOALS).startswith("FAIL bench_kernels rows=2")
        assert bench_kernels.summary_line([good, bad], GOALS).startswith("FAIL bench_kernels rows=2")


def test_bench_inference_summary_fails_when_compiled_tokens_differ():
    T = bench_inference.Timing
    eager = {"baseline": T(0.10, 0.010, [1, 2]), "block": T(0.11, 0.011, [3, 4])}
    compiled = {"baseline": T(0.08, 0.004, [1, 2]), "block": T(0.084, 0.0042, [3, 4])}
    assert bench_inference.summary_line({"eager": eager, "compiled": compiled}) == (
        "PASS compiled_decode block_prefill=1.050x block_decode=1.050x baseline_decode=4.00ms")
    compiled["block"] = T(0.084, 0.0042, [3, 5])
    assert bench_inference.summary_line({"eager": eager, "compiled": compiled}).startswith(
        "FAIL compiled_decode tokens differ from eager for block; block_prefill=1.050x")


def test_train_steps_finds_device_kernels_only_in_a_trace_that_has_them(tmp_path):
    cpu_only = tmp_path / "cpu.json"
    cpu_only.write_text(json.dumps({"traceEvents": [{"name": "aten::mm", "cat": "cpu_op"}]}))
    on_device = tmp_path / "cuda.json"
    on_device.write_text(json.dumps({"traceEvents": [{"name": "aten::mm", "cat": "cpu_op"},
                                                     {"name": "sm90_xmma_gemm", "cat": "kernel"}]}))
    assert train_steps._has_cuda_kernels(on_device)
    assert not train_steps._has_cuda_kernels(cpu_only)
    assert not train_steps._has_cuda_kernels(tmp_path / "missing.json")
