"""Train a comparison experiment through the normal trainer, then write its report.

    python -m scripts.compare experiment=quick [seeds=[0,1]] [train.steps=50 ...]
    python -m scripts.compare experiment=cpu_repro shard=0/2   # worker 0 of 2 (and shard=1/2 beside it)
    python -m scripts.compare experiment=long_blend_tuned report_only=true [runs_dir=DIR] [report_dir=DIR]
    python -m scripts.compare runs=[runs/a,runs/b] [report_dir=reports/mine]   # report only, these runs
    python -m scripts.compare runs='runs/quick/*' [runs=PATTERN ...] [report_dir=reports/mine]

Each run trains in this process into runs/<experiment>/<run>-s<seed>. A run whose newest checkpoint
is at train.steps, or that finished.json records as finished, is skipped (so a finished run's checkpoints
may be deleted to free disk); an unfinished one resumes (resume=auto). A finished.json its checkpoints
contradict is not believed (finished_at). Under torchrun every rank
walks the same plan, so the runs train data-parallel. The report goes to reports/<experiment>/.
An experiment with a tuning stage (`tune:`, scripts/experiments.py) trains it first; each arm's runs on the full
budget start once every run of the stage has finished, at the arm's chosen value.
report_only=true writes the report of the experiment's runs that have started (and its imports and tuning
sweep), naming those that have not, and trains nothing. Runs launched elsewhere (a cluster) are reported with
runs=[...] or runs=PATTERN (a glob; several runs= items are reported in their order). A shard trains its
share and writes no report: run the experiment once more without `shard` when every worker is done
(it skips the finished runs and reports on all of them).
"""
from __future__ import annotations

import glob
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from parallel.dims import init_distributed, shutdown
from scripts.cli import key, parse
from scripts.depth_matrix import DepthMatrixArgs, depth_matrix
from scripts.experiments import Evaluation, Experiment, PlannedRun, load_experiment
from scripts.report import build_report
from scripts.report.runs import EVAL_FILE, Run, read_jsonl
from scripts.report.tuning import choose, sweep_losses
from trainer.run_dir.checkpoint import STEP_DIR, latest_checkpoint
from trainer.run_dir.finished import FINISHED_FILE, finished_step
from trainer.config import ConfigError, load_config
from inference.export import export
from trainer.trainer import KNOWN_ERRORS, Trainer


@dataclass
class Args:
    experiment: str = key("quick", "configs/experiment/ name, or an experiment YAML's path")
    seeds: list[int] | None = key(None, "each run trains once per seed (null: the experiment's seeds:)")
    runs_dir: str | None = key(None, "where the runs train (null: runs/<experiment>)")
    report_dir: str | None = key(None, "where the report goes (null: reports/<experiment>)")
    shard: str | None = key(None, "K/N: train worker K of N's share of the runs and write no report")
    report_only: bool = key(False, "write the report of the runs that have started; train nothing")
    # main reads the runs= items itself (the key may repeat); declared here for --help
    runs: list[str] = key([], "report only these runs: [DIR,...] or a glob such as runs/quick/*; may repeat "
                              "(reported in order)")


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


def done_steps(run_dir: Path, say) -> int:
    return max(completed_steps(run_dir), finished_at(run_dir, say))


def train_runs(runs: list[PlannedRun], evaluation: Evaluation | None, info, say, stage: str = "") -> None:
    """Train every run of `runs` that is not finished (an unfinished one resumes)."""
    total = len(runs)
    configs = [load_config(run.overrides) for run in runs]
    for run, cfg in zip(runs, configs):
        refuse_to_retrain(run.run_dir, cfg.train.steps)
    for k, (run, cfg) in enumerate(zip(runs, configs), start=1):
        done = done_steps(run.run_dir, say)
        if done >= cfg.train.steps:
            say(f"{stage}{k}/{total} {run.name}: finished ({done}/{cfg.train.steps} steps), skipped")
        else:
            state = f"resuming at step {done}" if done else "training"
            say(f"{stage}{k}/{total} {run.name}: {state} to {cfg.train.steps} steps in {run.run_dir}")
            started = time.perf_counter()
            Trainer(cfg, info).fit()
            say(f"{stage}{k}/{total} {run.name}: done in {time.perf_counter() - started:.0f} s")
        if info.world_size == 1:
            ensure_depth_matrix(run.run_dir, say)
            ensure_evaluation(run.run_dir, evaluation, say)


def tuned_values(experiment: Experiment, say) -> dict[str, float] | None:
    """Each arm's chosen value, once every run of the tuning stage has finished (any worker's); None before,
    with a line naming the runs still to finish."""
    unfinished = [run for run in experiment.tuning.runs
                  if done_steps(run.run_dir, say) < load_config(run.overrides).train.steps]
    if unfinished:
        say(f"tuning stage: {len(unfinished)} of {len(experiment.tuning.runs)} runs not finished "
            f"({', '.join(run.name for run in unfinished)}); the runs on the full budget wait for them: run this "
            "again once they are")
        return None
    values = {}
    for arm in experiment.arms:
        runs = [Run.load(run.run_dir) for run in experiment.tuning.runs if run.arm == arm.name]
        choice = choose(sweep_losses(runs, experiment.tuning.key))
        if choice is None:
            raise ConfigError(f"tuning stage: run {arm.name} has no value whose runs all finished with a validation "
                              "loss; check its tuning runs' metrics.jsonl")
        values[arm.name] = choice.value
        edge = "; at the edge of the values tried: widen the sweep" if choice.at_edge else ""
        say(f"tuning stage: {arm.name} chooses {experiment.tuning.key}={choice.value:g} "
            f"(mean final loss {choice.losses[choice.value]:.4f}){edge}")
    return values


def train_experiment(experiment: Experiment) -> list[Path]:
    """Train every planned run of this worker that is not finished, the tuning stage first; returns the run
    directories in plan order (none for a shard: the report needs every worker's runs; none while the tuning
    stage waits for another worker's runs)."""
    info = init_distributed()
    say = progress if info.is_main else (lambda line: None)
    if experiment.tuning is not None and experiment.tuning.trained:
        train_runs(experiment.my_runs(experiment.tuning.runs), experiment.evaluation, info, say, "tuning ")
        values = tuned_values(experiment, say)
        if values is None:
            return []
        experiment.runs = experiment.tuned_runs(values)
    train_runs(experiment.my_runs(), experiment.evaluation, info, say)
    if experiment.shard is not None:
        say(f"shard {experiment.shard[0]}/{experiment.shard[1]} done; once every shard is, run "
            f"`python -m scripts.compare experiment={experiment.name}` without shard= for the report")
        return []
    return [run.run_dir for run in experiment.runs] if info.is_main else []


def experiment_report(experiment: Experiment, say) -> Path:
    """The report of the experiment's runs and imports that have started (those not yet started are named in
    it), with its tuning sweep where it has one."""
    if experiment.tuning is not None and experiment.tuning.trained and not experiment.runs:
        values = tuned_values(experiment, say)
        experiment.runs = experiment.tuned_runs(values) if values is not None else []
    planned = [*experiment.imports, *(run.run_dir for run in experiment.runs)]
    sweep = [run.run_dir for run in experiment.tuning.runs] if experiment.tuning is not None else []
    started = [path for path in planned if (path / "config.yaml").is_file()]
    missing = [str(path) for path in planned + sweep if not (path / "config.yaml").is_file()]
    if not started:
        raise ConfigError(f"experiment {experiment.name}: no run has started yet, so there is nothing to report "
                          f"(planned: {', '.join(str(path) for path in planned) or 'none before its tuning stage'})")
    return build_report(started, experiment.report_dir, f"Comparison report: experiment {experiment.name}", missing,
                        experiment.tuning.key if experiment.tuning is not None else None,
                        [path for path in sweep if (path / "config.yaml").is_file()])


def run_dirs_of(items: list[str]) -> list[str]:
    """The run directories of every runs= item in order: a list ([a,b]) or a glob pattern (runs/*-s?), sorted."""
    found = []
    for item in items:
        if item.startswith("["):
            found += [str(path) for path in OmegaConf.from_dotlist([f"runs={item}"]).runs]
        else:
            matches = sorted(glob.glob(item))
            if not matches:
                raise ConfigError(f"runs={item} matches no directory; give run directories as runs=[DIR,...] or a "
                                  "pattern such as runs=runs/quick/*")
            found += matches
    return found


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    # runs= may repeat, and each item is a list or a glob as typed (runs/[ab]*-s0), so the items are read here
    runs = [arg.partition("=")[2] for arg in argv if arg.startswith("runs=")]
    args, overrides = parse(Args, __doc__, [arg for arg in argv if not arg.startswith("runs=")], trainer_overrides=True)
    started = time.perf_counter()
    try:
        if runs:
            run_dirs = run_dirs_of(runs)
            report = build_report(run_dirs, args.report_dir or f"reports/{args.experiment}",
                                  f"Comparison report: {len(run_dirs)} runs")
        else:
            tool = [f"{name}={getattr(args, name)}" for name in ("seeds", "runs_dir", "report_dir", "shard")
                    if getattr(args, name) is not None]
            experiment = load_experiment(args.experiment, [*tool, *overrides], resolve=not args.report_only)
            if not args.report_only:
                share = f", this worker's share (shard {experiment.shard[0]}/{experiment.shard[1]}): " \
                        f"{len(experiment.my_runs())}" if experiment.shard and experiment.runs else ""
                tuning = f" after a tuning stage of {len(experiment.tuning.runs)}" \
                    if experiment.tuning is not None and experiment.tuning.trained else ""
                progress(f"experiment {experiment.name}: {len(experiment.runs) or len(experiment.arms)} "
                         f"{'runs' if experiment.runs else 'arms'}{tuning}{share}")
                if not train_experiment(experiment):
                    return
            report = experiment_report(experiment, progress)
    except (ConfigError, *KNOWN_ERRORS) as error:
        progress(f"error: {str(error).splitlines()[0]}")
        sys.exit(2)
    finally:
        shutdown()
    progress(f"report {report} ({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
