"""Train a comparison experiment through the normal trainer, then write its report.

    python -m scripts.compare experiment=quick [seeds=[0,1]] [train.steps=50 ...]
    python -m scripts.compare experiment=cpu_repro shard=0/2   # worker 0 of 2 (and shard=1/2 beside it)
    python -m scripts.compare runs=[runs/a,runs/b] [report_dir=reports/mine]   # report only
    python -m scripts.compare --report-only runs/a runs/b [--out reports/mine]

Each run trains in this process into runs/<experiment>/<run>-s<seed>. A run whose newest checkpoint
is at train.steps, or that finished.json records as finished, is skipped (so a finished run's checkpoints
may be deleted to free disk); an unfinished one resumes (resume=auto). A finished.json its checkpoints
contradict is not believed (finished_at). Under torchrun every rank
walks the same plan, so the runs train data-parallel. The report goes to reports/<experiment>/.
Runs launched elsewhere (a cluster) are reported with runs=[...] or --report-only. A shard trains its
share and writes no report: run the experiment once more without `shard` when every worker is done
(it skips the finished runs and reports on all of them).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from parallel.dims import init_distributed, shutdown
from scripts.depth_matrix import DepthMatrixArgs, depth_matrix
from scripts.experiments import Evaluation, Experiment, load_experiment, split_overrides
from scripts.report import build_report
from scripts.report.runs import EVAL_FILE, read_jsonl
from trainer.run_dir.checkpoint import STEP_DIR, latest_checkpoint
from trainer.run_dir.finished import FINISHED_FILE, finished_step
from trainer.config import ConfigError, load_config
from inference.export import export
from trainer.trainer import KNOWN_ERRORS, Trainer


def progress(line: str) -> None:
    print(f"[compare] {line}", file=sys.stderr, flush=True)


def completed_steps(run_dir: Path) -> int:
    # The step from the directory name: a damaged newest checkpoint is the trainer's to skip (resume=auto),
    # not a reason for the whole grid to stop.
    checkpoint = latest_checkpoint(run_dir)
    return int(STEP_DIR.fullmatch(checkpoint.name).group(1)) if checkpoint is not None else 0


def finished_at(run_dir: Path, say) -> int:
    """The step finished.json records, where the run's checkpoints agree: a run that still has checkpoints,
    none of them at that step or later, and whose metrics.jsonl logs no row at it never trained that far
    (a forged or misplaced finished.json) and is resumed, with one line saying so, instead of skipped. A run
    with no checkpoint left is believed: finished.json is what outlives checkpoints deleted on purpose (and
    where only the last one was deleted, its metrics still show the step)."""
    finished, newest = finished_step(run_dir), completed_steps(run_dir)
    if not finished or not newest or newest >= finished:
        return finished
    if any(isinstance(row, dict) and type(row.get("step")) is int and row["step"] == finished
           for row in read_jsonl(run_dir / "metrics.jsonl")):
        return finished
    say(f"{run_dir}: {FINISHED_FILE} records step {finished}, but its newest checkpoint is at step {newest} and "
        f"metrics.jsonl logs no step {finished}; not treated as finished")
    return 0


def refuse_to_retrain(run_dir: Path, steps: int) -> None:
    """A finished run whose checkpoints were deleted has nothing to extend to a longer train.steps; said
    before any run of the grid trains (the trainer would refuse only when that run's turn came)."""
    finished = finished_step(run_dir)
    if 0 < finished < steps and latest_checkpoint(run_dir) is None:
        raise ConfigError(f"{run_dir} finished at step {finished} and has no checkpoint to extend it to "
                          f"train.steps={steps}; start it in a new runs_dir, or keep train.steps={finished}")


def ensure_depth_matrix(run_dir: Path, say) -> None:
    """The report's M panel reads run_dir/depth_matrix/; one process computes what is missing (under
    torchrun, run `python -m scripts.depth_matrix checkpoint=RUN` afterwards)."""
    if (run_dir / "depth_matrix" / "depth_matrix.json").is_file() or latest_checkpoint(run_dir) is None:
        return
    say(depth_matrix(DepthMatrixArgs(checkpoint=str(run_dir))))


def ensure_evaluation(run_dir: Path, evaluation: Evaluation | None, say) -> None:
    """The report's downstream table reads run_dir/eval.json; one process writes what is missing."""
    if evaluation is None or (run_dir / EVAL_FILE).is_file() or latest_checkpoint(run_dir) is None:
        return
    # Imported here: lm_eval belongs to the eval extra, which an experiment without `eval:` does not need.
    from inference.evaluate import EvaluateArgs
    from inference.evaluate import run as evaluate

    say(f"{run_dir.name}: evaluating on {', '.join(evaluation.tasks)}")
    export_dir = run_dir / "eval-export"  # the newest checkpoint, exported for the evaluation only
    try:
        export(str(run_dir), str(export_dir), overwrite=True)
        evaluate(EvaluateArgs(model=str(export_dir), tasks=",".join(evaluation.tasks), limit=evaluation.limit,
                              num_fewshot=evaluation.num_fewshot, out=str(run_dir / EVAL_FILE)))
    finally:
        shutil.rmtree(export_dir, ignore_errors=True)


def train_experiment(experiment: Experiment) -> list[Path]:
    """Train every planned run of this worker that is not finished; returns the run directories in plan
    order (none for a shard: the report needs every worker's runs)."""
    info = init_distributed()
    say = progress if info.is_main else (lambda line: None)
    mine = experiment.my_runs()
    total = len(mine)
    configs = [load_config(run.overrides) for run in mine]
    for run, cfg in zip(mine, configs):
        refuse_to_retrain(run.run_dir, cfg.train.steps)
    for k, (run, cfg) in enumerate(zip(mine, configs), start=1):
        done = max(completed_steps(run.run_dir), finished_at(run.run_dir, say))
        if done >= cfg.train.steps:
            say(f"{k}/{total} {run.name}: finished ({done}/{cfg.train.steps} steps), skipped")
        else:
            state = f"resuming at step {done}" if done else "training"
            say(f"{k}/{total} {run.name}: {state} to {cfg.train.steps} steps in {run.run_dir}")
            started = time.perf_counter()
            Trainer(cfg, info).fit()
            say(f"{k}/{total} {run.name}: done in {time.perf_counter() - started:.0f} s")
        if info.world_size == 1:
            ensure_depth_matrix(run.run_dir, say)
            ensure_evaluation(run.run_dir, experiment.evaluation, say)
    if experiment.shard is not None:
        say(f"shard {experiment.shard[0]}/{experiment.shard[1]} done; once every shard is, run "
            f"`python -m scripts.compare experiment={experiment.name}` without shard= for the report")
        return []
    return [run.run_dir for run in experiment.runs] if info.is_main else []


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="experiment=NAME, runs=[DIRS], seeds=[...], runs_dir=, "
                                                     "report_dir=, shard=K/N, and trainer overrides for every run")
    parser.add_argument("--report-only", nargs="+", metavar="RUN_DIR", help="only build the report from these runs")
    parser.add_argument("--out", help="report directory for --report-only / runs= (default reports/<experiment>)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    options = {item.split("=", 1)[0]: item.split("=", 1)[1] for item in args.overrides if "=" in item}
    name = options.get("experiment", "quick")
    report_only = args.report_only
    if report_only is None and "runs" in options:
        report_only = list(OmegaConf.from_dotlist([f"runs={options['runs']}"]).runs)
    started = time.perf_counter()
    try:
        if report_only:
            tool, _ = split_overrides(args.overrides)
            report_dir = args.out or OmegaConf.from_dotlist(tool).get("report_dir") or f"reports/{name}"
            report = build_report(list(report_only), report_dir, f"Comparison report: {len(report_only)} runs")
        else:
            rest = [item for item in args.overrides if item.split("=", 1)[0] != "experiment"]
            experiment = load_experiment(name, rest)
            share = f", this worker's share (shard {experiment.shard[0]}/{experiment.shard[1]}): " \
                    f"{len(experiment.my_runs())}" if experiment.shard else ""
            progress(f"experiment {experiment.name}: {len(experiment.runs)} runs{share}")
            run_dirs = train_experiment(experiment)
            if not run_dirs:
                return
            report = build_report(run_dirs, args.out or experiment.report_dir,
                                  f"Comparison report: experiment {experiment.name}")
    except (ConfigError, *KNOWN_ERRORS) as error:
        progress(f"error: {str(error).splitlines()[0]}")
        sys.exit(2)
    finally:
        shutdown()
    progress(f"report {report} ({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
