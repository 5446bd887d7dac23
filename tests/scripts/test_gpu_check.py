"""scripts/gpu_check.sh without a GPU: its rehearsal runs every check's entry point on the CPU through the same
command line, files and summary (a check that crashes here would crash on the lent machine); a real run
refuses in one line; the PASS/FAIL lines of the benchmarks' --summary judge the right figures."""
import json
import math
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from scripts.bench import inference as bench_inference
from scripts.bench import kernels as bench_kernels
from scripts.gpu_checks.run import CHECKS, REHEARSAL_SLACK

REPO = Path(__file__).resolve().parents[2]


def gpu_check(*args, out):
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], capture_output=True, text=True, cwd=REPO, timeout=900,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_OUT": str(out)})


@pytest.mark.compile  # its compiled_decode check, and the Triton kernels under the interpreter
def test_the_rehearsal_runs_every_check_on_the_cpu_and_skips_only_what_needs_cuda(tmp_path):
    result = gpu_check("--rehearse", out=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["rehearse"] and report["device"] != "" and report["torch"].startswith("2.")
    checks = {r["check"]: r for r in report["checks"]}
    limits = {c.name: c.limit_s for c in CHECKS}
    assert list(checks) == [c.name for c in CHECKS] == ["triton_kernels", "kernel_bandwidth", "fla_chunk_kda",
                                                         "train_step_bf16", "resume", "compiled_decode"]
    for name, r in checks.items():
        # Every check has a step only CUDA can run, and names what it would have measured.
        assert r["status"] in ("PASS", "SKIP") and r["skipped"] and all(len(what) > 20 for what in r["skipped"]), r
        assert r["line"].startswith(f"{r['status']} {name} ") and r["seconds"] < r["limit_s"], r
        assert r["limit_s"] == limits[name] * REHEARSAL_SLACK, r  # the CPU's slack over the device's limit
        assert (tmp_path / name / "log.txt").is_file()
    assert checks["triton_kernels"]["status"] == "SKIP" and "kernel tests on CUDA" in checks["triton_kernels"]["skipped"][0]
    assert checks["kernel_bandwidth"]["figures"]["copy_gb_per_s"] > 0
    assert len(checks["kernel_bandwidth"]["figures"]["kernels"]) == 6
    kda = checks["fla_chunk_kda"]["figures"]
    assert set(kda["errors"]) == {"initial_state", "cu_seqlens"} and max(kda["max_rel_error"].values()) < 1e-4
    assert len(kda["errors"]["initial_state"]) == 8 and len(kda["errors"]["cu_seqlens"]) == 6
    step = checks["train_step_bf16"]["figures"]
    assert set(step["ratio_to_baseline"]) == {"block", "full"} and all(v > 0 for v in step["step_ms"].values())
    assert step["mfu"] == {"baseline": None, "block": None, "full": None} and step["peak_mem_mb"] is None
    resumed = checks["resume"]["figures"]
    assert resumed["bitwise"] and resumed["max_rel_loss_difference"] == 0 and resumed["peak_mem_mb"] > 0
    assert set(checks["compiled_decode"]["figures"]) == {"eager"}
    # The one-screen summary: printed last and written beside the figures.
    summary = (tmp_path / "summary.txt").read_text()
    assert len(summary.splitlines()) == 2 + len(CHECKS) and summary in result.stdout
    assert summary.splitlines()[-1].startswith(f"{len(CHECKS)} of {len(CHECKS)} checks passed or skipped in ")


def test_without_a_gpu_a_real_run_refuses_in_one_line(tmp_path):
    result = gpu_check(out=tmp_path)
    assert result.returncode == 2 and not (tmp_path / "gpu_check.json").exists()
    # Before anything is installed from .gpu/wheels.
    assert result.stderr == (f"gpu_check: no CUDA device visible to {sys.executable} (torch.cuda.is_available() is "
                             "False); --rehearse runs every check on the CPU, PYTHON=INTERPRETER picks another\n")
    assert result.stdout == ""
    assert gpu_check("--fast", out=tmp_path).stderr == "gpu_check: unknown argument '--fast'; the only option is --rehearse\n"


def refused_interpreter(repo: Path, **env) -> str:
    """The interpreter a real run in `repo` (a copy of the script, no CUDA) tried, as its refusal names it."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    result = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                            timeout=60, env={**environment, "CUDA_VISIBLE_DEVICES": "", **env})
    assert result.returncode == 2, result.stderr
    return result.stderr.removeprefix("gpu_check: no CUDA device visible to ").partition(" (torch.cuda")[0]


def test_the_interpreter_is_the_repositorys_venv_where_make_setup_built_one(tmp_path):
    """After `make setup` torch is only in .venv: the rehearsal failed on python3's 'No module named torch'."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu_check.sh").write_text((REPO / "scripts" / "gpu_check.sh").read_text())
    assert refused_interpreter(repo) == "python3"
    venv_python = repo / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(tmp_path / "gone")  # a .venv whose interpreter is missing is no interpreter
    assert refused_interpreter(repo) == "python3"
    venv_python.unlink()
    venv_python.symlink_to(sys.executable)
    assert refused_interpreter(repo) == ".venv/bin/python"
    assert refused_interpreter(repo, PYTHON=sys.executable) == sys.executable


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
