"""Shared fixtures: a tiny prepared corpus (no network) and trainer overrides for fast runs."""
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

# Inductor compiles in this process: its default pool of compile workers (one per core) costs each process that
# compiles a few CPU-seconds to start, and on 2 cores that pytest-xdist already keeps busy it buys nothing.
# Set before torch is imported; torchrun ranks and CLI subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

# First, before any test module imports triton (pytest collects tests/inference before tests/kernels): the
# Triton kernels run under the interpreter on CPU, and a kernel built otherwise cannot call an interpreted one.
import kernel_device  # noqa: F401
from trainer.data import prepare_text_corpus



@pytest.fixture(autouse=True, scope="session")
def one_thread_per_worker():
    """pytest runs one worker per core (-n 2); more threads per worker only wait on each other
    (Muon's bf16 Newton-Schulz slows down ~5x with two threads on a busy 2-core machine)."""
    torch.set_num_threads(1)


WORDS = "the king queen lord crown sword night day love death speak hath thou thee fair foul ghost".split()


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """A prepared dataset of pseudo-English text with a 512-token BPE (model=xs's vocab)."""
    root = tmp_path_factory.mktemp("tiny_corpus")
    rng = random.Random(0)
    texts = root / "texts"
    texts.mkdir()
    for i in range(30):
        lines = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(80))
        (texts / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return prepare_text_corpus([texts], root / "prepared", 512)


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A directory that `build(directory)` fills once per test session, however many pytest-xdist workers ask
    for it (xdist's recipe: the workers' base temporary directories share a parent, and a file lock lets one
    build while the others wait), so that a module fixture whose tests xdist splits across workers does not
    pay for its launch twice. Returns the directory; a build that raises leaves it to the next caller."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    directory, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            done.touch()
    return directory


def fast_train_overrides(run_dir, dataset, steps=6, **extra):
    overrides = {
        "model": "xs", "run.dir": str(run_dir), "data.path": str(dataset), "train.steps": steps,
        "train.seq_len": 32, "train.micro_batch": 2, "train.global_batch": 4, "train.log_every": 1,
        "train.eval_every": 3, "train.eval_batches": 2, "train.ckpt_every": 3, "train.diag_every": 3,
        "train.warmup_steps": 2, "logging.wandb.mode": "disabled",
    }
    overrides.update(extra)
    return [f"{k}={v}" for k, v in overrides.items()]


def task_rows(run_dir) -> dict:
    """{step: {"eval/<task>/<metric>": value}} of a run's train.eval_tasks rows in metrics.jsonl."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows if "eval_tasks_time_s" in r}


def train_in_process(overrides):
    """One trainer run in this process, as trainer.main runs it."""
    from parallel.dims import init_distributed
    from trainer.config import load_config
    from trainer.trainer import Trainer

    return Trainer(load_config(overrides), init_distributed()).fit()


def cli_error(capsys, main, argv) -> str:
    """The one `error: ...` line (exit code 2) that one of our key=value CLIs prints for `argv`."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def torchrun(overrides, nproc=2, max_restarts=0, timeout=240):
    """Launch trainer.main under torchrun on gloo; returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", "trainer.main", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def torchrun_runs(runs, workdir, nproc=2, timeout=600):
    """Train every run of `runs` (lists of overrides, as fast_train_overrides gives) one after another in
    one launch of `nproc` ranks (tests/parallel/trainer_runs_worker.py); returns the CompletedProcess."""
    runs_file = Path(workdir) / "runs.json"
    runs_file.write_text(json.dumps(runs))
    return preloaded_launch("trainer_runs_worker", nproc, str(runs_file), timeout=timeout)


def preloaded_launch(worker: str, nproc: int, *args: str, timeout: float):
    """Run tests/parallel/<worker>.py's main(*args) on `nproc` gloo ranks, forked by torchrun's agent from a
    server that imported the worker once (tests/parallel/preloaded_launch.py); returns the CompletedProcess."""
    cmd = [sys.executable, str(Path(__file__).parent / "parallel" / "preloaded_launch.py"), str(nproc), worker, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def launch_parity_worker(worker, nproc: int):
    """Run a parity worker (a path in tests/parallel) on `nproc` ranks; returns its CASE lines and its CONTROL
    lines as dicts."""
    result = preloaded_launch(Path(worker).stem, nproc, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    cases = [json.loads(line[5:]) for line in lines if line.startswith("CASE ")]
    controls = [json.loads(line[8:]) for line in lines if line.startswith("CONTROL ")]
    return cases, controls
