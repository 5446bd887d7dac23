"""Run every check of scripts/gpu_check.sh in order, each in its own process under its own time limit (a
check that runs out of time is stopped and the rest still run), then write every figure into one file,
<out>/gpu_check.json, and a one-screen summary, <out>/summary.txt (also printed).

    python -m scripts.gpu_checks.run out=DIR [rehearse=true]

Exit status: 0 when no check failed or ran out of time, 1 otherwise.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from scripts.cli import fail, parse
from scripts.gpu_checks.result import RESULT_FILE, CheckArgs

SUMMARY_FILE, JSON_FILE = "summary.txt", "gpu_check.json"
# What the lent machine's command has left after the bundle install (about 10 s), of its 9 minutes.
BUDGET_S = 520


class Check(NamedTuple):
    name: str
    module: str      # scripts.gpu_checks.<module>
    limit_s: int     # on an H100, its first compiles included


# Guesses until a device has run them: fla's kernels autotune on their first call (c, and again for the
# trainer's shapes in e), inductor compiles three decode steps (f).
CHECKS = (
    Check("triton_kernels", "kernels", 100),
    Check("kernel_bandwidth", "bandwidth", 45),
    Check("fla_chunk_kda", "fla_kda", 70),
    Check("train_step_bf16", "train_step", 120),
    Check("resume", "resume", 75),
    Check("compiled_decode", "decode", 110),
)
assert sum(check.limit_s for check in CHECKS) <= BUDGET_S, "the checks' limits exceed the lent command's time"
# A rehearsal runs on a CPU that other work may share (the suite's other worker and its launches): its limits are
# the device's times this, so that a check that hangs runs out, not one that waited for a core (a loaded 2-core
# machine took 104 s of triton_kernels' 100).
REHEARSAL_SLACK = 4


def run_check(check: Check, out: Path, rehearse: bool) -> dict:
    """Run one check under its limit; its result.json, or what stood in for it (time out, crash)."""
    folder = out / check.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RESULT_FILE).unlink(missing_ok=True)
    command = [sys.executable, "-m", f"scripts.gpu_checks.{check.module}", f"out={folder}"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiled kernels on CUDA
    if rehearse:
        command.append("rehearse=true")
        env["CUDA_VISIBLE_DEVICES"] = ""  # a rehearsal is the CPU's, even on a machine with a GPU
    limit_s = check.limit_s * (REHEARSAL_SLACK if rehearse else 1)
    log = folder / "log.txt"
    began = time.perf_counter()
    with log.open("w") as sink:
        # Its own session: a time-out stops the check's workers (pytest-xdist, inductor) with it.
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    seconds = time.perf_counter() - began
    timing = {"check": check.name, "limit_s": limit_s, "seconds": round(seconds, 1), "log": str(log)}
    if (folder / RESULT_FILE).is_file():
        return {**json.loads((folder / RESULT_FILE).read_text()), **timing}
    if process.returncode == -signal.SIGKILL:
        return {**timing, "status": "TIMEOUT", "line": f"TIMEOUT {check.name} stopped after {limit_s} s"}
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["(no output)"]
    return {**timing, "status": "FAIL", "line": f"FAIL {check.name} exit {process.returncode}: {tail[0][:200]}"}


def environment() -> dict:
    import torch
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "host": platform.node()}


def summary(report: dict) -> str:
    lines = [f"gpu_check{' --rehearse' if report['rehearse'] else ''}: {report['device']}, torch {report['torch']}, "
             f"triton {report['triton']}, python {report['python']}"]
    lines += [f"{r['line']} [{r['seconds']:.0f}/{r['limit_s']} s]" for r in report["checks"]]
    failed = [r["check"] for r in report["checks"] if r["status"] in ("FAIL", "TIMEOUT")]
    lines.append(f"{len(report['checks']) - len(failed)} of {len(report['checks'])} checks passed or skipped in "
                 f"{report['seconds']:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(CheckArgs, __doc__, argv)
    if not args.out:
        fail("out= is required: the folder for gpu_check.json, summary.txt and each check's folder")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    report = {"rehearse": args.rehearse, **environment(), "checks": []}
    for check in CHECKS:
        report["checks"].append(run_check(check, out, args.rehearse))
        print(report["checks"][-1]["line"], flush=True)
    report["seconds"] = round(time.perf_counter() - began, 1)
    (out / JSON_FILE).write_text(json.dumps(report, indent=1))
    text = summary(report)
    (out / SUMMARY_FILE).write_text(text + "\n")
    print(f"\n{text}\n\nfigures: {out / JSON_FILE}")
    return 1 if any(r["status"] in ("FAIL", "TIMEOUT") for r in report["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
