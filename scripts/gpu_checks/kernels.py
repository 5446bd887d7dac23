"""(a) Every Triton kernel on CUDA against its torch reference, outputs and all gradients: the tests of
tests/kernels run with KERNEL_TEST_DEVICE=cuda (compiled kernels on CUDA tensors, TRITON_INTERPRET unset),
spread over worker processes (pytest-xdist) so the first compiles run side by side. The ahead-of-time
table (test_aot) needs no GPU and runs in the suite.

    python -m scripts.gpu_checks.kernels out=DIR [rehearse=true]    (rehearsal: the tests are collected on
                                                                    the CPU, not run)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

from scripts.gpu_checks.result import Result, parse_args

WORKERS = 8
# --noconftest: the kernel tests take no fixture from tests/conftest.py, whose imports (the data layer) cost seconds.
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "tests/kernels",
          "--ignore=tests/kernels/test_aot.py"]


def counts(output: str) -> dict[str, int]:
    """pytest's closing tally ('3 passed, 1 failed in 2.0s', '12 tests collected in 1.0s') as numbers."""
    last = output.strip().splitlines()[-1] if output.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|tests? collected)", last)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    result = Result("triton_kernels")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # tests/kernel_device.py picks the device; without conftest.py, pytest does not put tests/ on the path.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, ["tests", env.get("PYTHONPATH")]))
    if args.rehearse:
        env["KERNEL_TEST_DEVICE"] = "cpu"
        run = subprocess.run([*PYTEST, "--collect-only"], env=env, capture_output=True, text=True)
    else:
        env["KERNEL_TEST_DEVICE"] = "cuda"
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or WORKERS) // WORKERS))  # the references' CPU work
        run = subprocess.run([*PYTEST, "-n", str(WORKERS)], env=env, capture_output=True, text=True)
    (args.out / "pytest.log").write_text(run.stdout + run.stderr)
    tally = counts(run.stdout)
    if args.rehearse:
        collected = sum(n for word, n in tally.items() if "collected" in word)
        if run.returncode != 0 or not collected:
            result.problems.append(f"collecting tests/kernels failed (exit {run.returncode}; pytest.log)")
        result.skip(f"{collected} kernel tests on CUDA: every Triton kernel's outputs and gradients vs its reference")
        result.finish(args.out, f"collected={collected}")
    passed, failed = tally.get("passed", 0), tally.get("failed", 0) + tally.get("error", 0) + tally.get("errors", 0)
    result.figures.update(passed=passed, failed=failed)
    if run.returncode != 0 or not passed:
        result.problems.append(f"{failed} failed, {passed} passed (exit {run.returncode}; pytest.log)")
    result.finish(args.out, f"passed={passed} failed={failed}")


if __name__ == "__main__":
    main()
