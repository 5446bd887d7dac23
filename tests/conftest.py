"""Shared fixtures: a tiny prepared corpus (no network) and trainer overrides for fast runs."""
import json
import os
import random
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


@pytest.fixture(autouse=True, scope="session")
def data_cache_of_the_session(tmp_path_factory):
    """Every dataset and megatron-core sample index the session prepares goes to a cache of its own (the launches
    and CLI subprocesses inherit it), as on a fresh machine: nothing is read from or left in the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTNRES_DATA_CACHE", str(tmp_path_factory.mktemp("data_cache")))
        yield


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


# -- test tiers and launches ----------------------------------------------------------------------
# `make test-fast` runs the tests marked none of `launch` (they start processes under torchrun: each launch
# costs seconds of imports per rank, and its runs share 2 cores with everything else), `lm_eval` (they run
# lm_eval's evaluation in the test's process), `compile` and `slow` (pytest.ini). A test launches only through
# the fixtures below, and requesting one marks it; a test that runs lm_eval carries the mark itself, and one that
# forgets fails (`pytest_runtest_protocol`). Launched tests may run lm_eval too (in the launch or beside it).
# A run that deselects `slow` ends by naming the unmarked tests that took longer than SLOW_S.
LAUNCH_FIXTURES = {"launched", "torchrun", "torchrun_runs"}
SLOW_S = 3.0


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if LAUNCH_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.launch)


def pytest_terminal_summary(terminalreporter, config):
    if "not slow" not in (config.getoption("markexpr") or ""):
        return
    slow = sorted({report.nodeid for reports in terminalreporter.stats.values() for report in reports
                   if getattr(report, "when", None) == "call" and report.duration > SLOW_S})
    if slow:
        terminalreporter.write_line(f"the fast tier ran {len(slow)} test(s) over {SLOW_S:.0f} s; mark them "
                                    "@pytest.mark.slow (pytest.ini):")
        for nodeid in slow:
            terminalreporter.write_line(f"  {nodeid}")


def _unmarked_lm_eval(*args, **kwargs):
    raise AssertionError("this test runs lm_eval's evaluation (in its body or a fixture it uses): mark it "
                         "@pytest.mark.lm_eval (tests/conftest.py, test tiers)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that runs lm_eval's evaluation without the `lm_eval` mark, in its setup (module fixtures
    included), call or teardown, fails naming the mark, rather than slowing the fast tier. lm_eval is patched
    where it is already imported (collecting tests/inference/test_evaluate.py imports it), the same object
    trainer/ and inference/ call."""
    lm_eval = sys.modules.get("lm_eval")
    if lm_eval is None or any(item.get_closest_marker(mark) for mark in ("lm_eval", "launch")):
        yield
        return
    evaluate, lm_eval.simple_evaluate = lm_eval.simple_evaluate, _unmarked_lm_eval
    try:
        yield
    finally:
        lm_eval.simple_evaluate = evaluate


def _torchrun(args, nproc=2, max_restarts=0, timeout=240, module="trainer.main"):
    """Launch `module` (trainer.main: `args` are its overrides) under torchrun on gloo; returns the
    CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", module, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def torchrun():
    """`torchrun` as a user runs it, for the tests of launching itself (restarts, refusals, the run lock, a
    CLI, failing fast); everything else trains in the session's launches (`launched`)."""
    return _torchrun


def _preloaded_launch(worker: str, nproc: int, *args: str, timeout: float):
    """Run tests/parallel/<worker>.py's main(*args) on `nproc` gloo ranks, forked by torchrun's agent from a
    server that imported the worker once (tests/parallel/preloaded_launch.py); returns the CompletedProcess."""
    cmd = [sys.executable, str(Path(__file__).parent / "parallel" / "preloaded_launch.py"), str(nproc), worker, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _launch_jobs(jobs: list[dict], jobs_file: Path, nproc: int, timeout: float):
    jobs_file.write_text(json.dumps(jobs))
    return _preloaded_launch("launch_worker", nproc, str(jobs_file), timeout=timeout)


@pytest.fixture
def torchrun_runs():
    """`torchrun_runs(runs, workdir, nproc=2)`: train every run of `runs` (lists of overrides, as
    fast_train_overrides gives) in one launch of its own, outputs in `workdir`; returns the CompletedProcess
    with the ranks' output. For a launch that depends on what a test did after an earlier one; anything
    else goes into the session's launches (`launch_job`)."""
    def launch(runs, workdir, nproc=2, timeout=600):
        result = _launch_jobs([{"directory": str(workdir), "runs": runs}], Path(workdir) / "runs.json", nproc, timeout)
        result.stdout += job_output(Path(workdir), "stdout")
        result.stderr += job_output(Path(workdir), "stderr")
        return result
    return launch


@dataclass(frozen=True)
class LaunchJob:
    """A share of the session's launch of `world` ranks: the trainer runs `build(directory, dataset)` returns
    (it may train in this process first, what the runs resume), or a parity worker's report."""
    name: str
    world: int
    build: Callable[[Path, Path], list[list[str]]] | None = None
    parity: str | None = None


# Every job of the modules imported (collected, or imported by those): a world size's launch runs them all.
LAUNCH_JOBS: dict[str, LaunchJob] = {}
# The 2-rank launch holds most of the suite's multi-rank runs: about 10 CPU-minutes.
SESSION_LAUNCH_TIMEOUT_S = 3600


def _registered(job: LaunchJob) -> LaunchJob:
    assert LAUNCH_JOBS.setdefault(job.name, job) == job, f"two launch jobs named {job.name}"
    return job


def launch_job(world: int, name: str | None = None):
    """Decorator: `build(directory, dataset) -> runs` becomes a job of the session's `world`-rank launch."""
    return lambda build: _registered(LaunchJob(name or f"{build.__module__}.{build.__name__}", world, build=build))


def parity_job(worker: str, world: int) -> LaunchJob:
    """tests/parallel/<worker>.py's checks as a job of the session's `world`-rank launch."""
    return _registered(LaunchJob(f"{worker}_{world}", world, parity=worker))


def _session_launch(world: int, root: Path, dataset: Path) -> None:
    """Build every job of `world` ranks under root/<job name>, then run them all in one launch;
    records the launch's exit code and output (a failed launch is every job's failure, not retried)."""
    jobs = []
    try:
        for job in sorted((job for job in LAUNCH_JOBS.values() if job.world == world), key=lambda job: job.name):
            directory = root / job.name
            directory.mkdir()
            jobs.append({"directory": str(directory), "parity": job.parity} if job.parity else
                        {"directory": str(directory), "runs": job.build(directory, dataset)})
        result = _launch_jobs(jobs, root / "jobs.json", world, SESSION_LAUNCH_TIMEOUT_S)
        returncode, output = result.returncode, result.stderr
    except Exception:  # a job's build, or the launch's timeout
        returncode, output = 1, traceback.format_exc()
    (root / "returncode").write_text(str(returncode))
    (root / "stderr.txt").write_text(output)


@pytest.fixture(scope="session")
def launched(tmp_path_factory, tiny_dataset):
    """`launched(job)`: the job's directory once the session's launch of its world size has run, started by
    whichever pytest-xdist worker asks first (the other waits for it: `built_once`). The runs read the tiny
    dataset of the worker that launched them: every worker prepares the same tokens from the same seed."""
    def directory_of(job: LaunchJob) -> Path:
        root = built_once(tmp_path_factory, f"launch_{job.world}",
                          lambda root: _session_launch(job.world, root, tiny_dataset))
        directory = root / job.name
        if not (directory / "done").exists():
            pytest.fail(_launch_failure(root, job))
        return directory
    return directory_of


def _launch_failure(root: Path, job: LaunchJob) -> str:
    """Why `job` did not finish: the launch's output, and the ranks' of the job that failed (the first not done)."""
    text = (f"the {job.world}-rank launch did not finish {job.name} (exit code {(root / 'returncode').read_text()}):\n"
            + (root / "stderr.txt").read_text()[-3000:])
    jobs = json.loads((root / "jobs.json").read_text()) if (root / "jobs.json").exists() else []
    failed = next((Path(j["directory"]) for j in jobs if not (Path(j["directory"]) / "done").exists()), None)
    for path in sorted(failed.glob("rank*.stderr")) if failed else []:
        text += f"\n--- {failed.name}/{path.name}:\n{path.read_text()[-3000:]}"
    return text


def job_output(directory: Path, stream: str = "stderr") -> str:
    """Every rank's stdout or stderr of a launched job."""
    return "".join(path.read_text() for path in sorted(directory.glob(f"rank*.{stream}")))


def report_lines(directory: Path) -> dict[str, list[dict]]:
    """A parity job's report: rank 0's JSON lines by their first word (CASE, CONTROL, ...)."""
    lines: dict[str, list[dict]] = {}
    for line in (directory / "rank0.stdout").read_text().splitlines():
        kind, _, value = line.partition(" ")
        if kind.isupper() and value.startswith("{"):
            lines.setdefault(kind, []).append(json.loads(value))
    return lines
