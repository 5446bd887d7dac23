"""Comparison experiments: a grid of runs read from configs/experiment/<name>.yaml.

An experiment file holds
    seeds: [0, 1]              every run is trained once per seed (seed sets init and data order)
    shared: [train.steps=...]  trainer overrides every run gets: same data, tokens and hyperparameters
    runs:                      name + overrides (model size, variant and its options); optional seeds
      - {name: s-block, overrides: [model=s, variant=block]}
and optionally runs_dir / report_dir (default runs/<name>, reports/<name>) and
    eval: {tasks: [attnres_local], limit: 50, num_fewshot: 0}
which evaluates every finished run on those lm_eval tasks (inference.evaluate; run_dir/eval.json) for the
report's downstream table, and optionally
    tune: {key: optim.lr, values: [7.5e-4, 1.5e-3, 3e-3], steps: 1000, seeds: [0]}
a tuning stage: every run (an arm) first trains at every value on the short budget, into
<runs_dir>/tune/<run>-<label><value>-s<seed> (label: lr, muon_lr or bias_rate); each arm's value is the one with
the lowest final validation loss (scripts/report/tuning.py), and the arm's runs on the experiment's own budget
then train at it, as <run>-<label><value>-s<seed>. Two keys only shape the report, and train nothing:
    imports: [docs/results/long_blend/runs/baseline-s0, ...]        run directories of other experiments
    tuned_on: {key: optim.lr, runs: [DIR, ...]}   a sweep trained elsewhere that chooses each arm's value
`shard=K/N` (command line only) keeps every N-th planned run starting at K (of the tuning stage, then of the
runs), so N workers (processes on one machine, or jobs on a cluster sharing the runs directory) split one
experiment without training a run twice. The files are read with OmegaConf, not composed by Hydra: they
describe many trainer configs, not one.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from scripts.report.tuning import TUNABLE
from trainer.config import CONFIG_DIR, ConfigError

EXPERIMENT_DIR = CONFIG_DIR / "experiment"
TOOL_KEYS = ("seeds", "runs_dir", "report_dir", "shard")  # the experiment's own keys; the rest go to the trainer


@dataclass
class PlannedRun:
    name: str            # <run>-s<seed>, also the run directory's name
    run_dir: Path
    overrides: list[str]
    arm: str = ""        # the `runs:` entry it was planned from


@dataclass
class Evaluation:
    """The experiment's `eval:` block: lm_eval tasks every finished run is evaluated on."""
    tasks: list[str]
    limit: float | None = None   # examples per task (a fraction below 1: that share); None: all
    num_fewshot: int = 0


@dataclass
class Arm:
    """One `runs:` entry: its name, overrides and seeds."""
    name: str
    overrides: list[str]
    seeds: list[int]


@dataclass
class Tuning:
    """The experiment's `tune:` stage (`runs`: every arm at every value), or with `trained=False` the sweep
    `tuned_on:` names, trained elsewhere (`runs`: its directories as PlannedRuns, no overrides)."""
    key: str
    runs: list[PlannedRun]
    trained: bool = True


@dataclass
class Experiment:
    name: str
    report_dir: Path
    runs: list[PlannedRun]  # with a tuning stage: none until tuned_runs gives each arm its value
    shard: tuple[int, int] | None = None  # (K, N): this worker trains runs K, K+N, K+2N, ... of each stage
    evaluation: Evaluation | None = None
    tuning: Tuning | None = None
    imports: list[Path] = field(default_factory=list)
    arms: list[Arm] = field(default_factory=list)
    plan_run: Callable[..., PlannedRun] | None = None  # (arm, seed, extra overrides, name) -> PlannedRun

    def my_runs(self, runs: list[PlannedRun] | None = None) -> list[PlannedRun]:
        runs = self.runs if runs is None else runs
        if self.shard is None:
            return runs
        k, n = self.shard
        return runs[k::n]

    def tuned_runs(self, values: dict[str, float]) -> list[PlannedRun]:
        """The arms' runs on the experiment's budget, each at its value of the tuned key (arm name -> value)."""
        label = TUNABLE[self.tuning.key]
        return seed_major([(arm, seed) for arm in self.arms for seed in arm.seeds],
                          lambda arm, seed: self.plan_run(arm, seed, [f"{self.tuning.key}={values[arm.name]}"],
                                                          f"{arm.name}-{label}{values[arm.name]:g}-s{seed}"))


def parse_shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(part) for part in str(text).split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise ConfigError(f"shard={text} must be K/N with 0 <= K < N (worker K of N), e.g. shard=0/2")
    return k, n


def parse_evaluation(spec, path: Path) -> Evaluation | None:
    if spec is None:
        return None
    keys = set(spec) - {"tasks", "limit", "num_fewshot"}
    tasks = spec.get("tasks")
    if keys or not tasks or not all(isinstance(task, str) and task for task in tasks):
        raise ConfigError(f"{path}: eval must be {{tasks: [NAME, ...], limit: N, num_fewshot: N}} with at least one "
                          f"task name; got {OmegaConf.to_container(spec)}")
    return Evaluation(list(tasks), spec.get("limit"), spec.get("num_fewshot", 0))


def experiment_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".yaml":
        return path
    path = EXPERIMENT_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = " | ".join(sorted(p.stem for p in EXPERIMENT_DIR.glob("*.yaml")))
        raise ConfigError(f"experiment={name_or_path!r} is not one of {known} (or a path to a .yaml file)")
    return path


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the tool's own key=value items, trainer overrides)."""
    tool = [item for item in overrides if item.split("=", 1)[0] in TOOL_KEYS]
    return tool, [item for item in overrides if item not in tool]


def seed_major(pairs: list[tuple[Arm, int]], plan) -> list[PlannedRun]:
    """plan(arm, seed) for every pair, seed-major: an experiment stopped part-way holds complete comparisons
    for its first seeds."""
    ordered_seeds = list(dict.fromkeys(seed for _, seed in pairs))
    return [plan(arm, seed) for arm, seed in sorted(pairs, key=lambda pair: ordered_seeds.index(pair[1]))]


def parse_tune(spec, arms: list[Arm], path: Path) -> tuple[str, list[float], int, list[int]]:
    keys = set(spec) - {"key", "values", "steps", "seeds"}
    values, steps, seeds = spec.get("values"), spec.get("steps"), spec.get("seeds")
    if (keys or spec.get("key") not in TUNABLE or not values or not all(isinstance(v, (int, float)) for v in values)
            or len(set(values)) != len(values) or not isinstance(steps, int) or steps < 1 or not seeds):
        raise ConfigError(f"{path}: tune must be {{key: {' | '.join(TUNABLE)}, values: [distinct numbers], steps: N "
                          f">= 1, seeds: [...]}}; got {OmegaConf.to_container(spec)}")
    setting = next((arm.name for arm in arms if any(o.split("=", 1)[0] == spec.key for o in arm.overrides)), None)
    if setting is not None:
        raise ConfigError(f"{path}: run {setting} sets {spec.key}, which the tuning stage chooses; remove it")
    return spec.key, sorted(values), steps, list(seeds)


def parse_tuned_on(spec, path: Path) -> Tuning:
    if set(spec) != {"key", "runs"} or spec.key not in TUNABLE or not spec.runs:
        raise ConfigError(f"{path}: tuned_on must be {{key: {' | '.join(TUNABLE)}, runs: [RUN_DIR, ...]}}; got "
                          f"{OmegaConf.to_container(spec)}")
    return Tuning(spec.key, [PlannedRun(Path(run).name, Path(run), []) for run in spec.runs], trained=False)


def load_experiment(name_or_path: str, overrides: list[str] = (), resolve: bool = True) -> Experiment:
    """The experiment's runs; `overrides` may set seeds / runs_dir / report_dir, the rest reach every run.
    resolve=False leaves the shared overrides' interpolations (${oc.env:...}) unresolved: a report reads run
    directories, not the environment the runs trained in."""
    path = experiment_path(name_or_path)
    tool, trainer_overrides = split_overrides(list(overrides))
    spec = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(tool))
    shared = list(spec.get("shared", [])) if resolve else OmegaConf.to_container(spec.get("shared") or [],
                                                                                  resolve=False)
    name = path.stem
    runs_dir = Path(spec.get("runs_dir") or f"runs/{name}")
    arms = [Arm(run.name, list(run.overrides), list(run.get("seeds") or spec.seeds)) for run in spec.runs]

    def plan_run(arm: Arm, seed: int, extra: list[str], run_name: str, where: Path = runs_dir) -> PlannedRun:
        run_dir = where / run_name
        return PlannedRun(run_name, run_dir, [*shared, *arm.overrides, *trainer_overrides, *extra,
                                              f"seed={seed}", f"run.dir={run_dir}", "resume=auto"], arm.name)

    shard = parse_shard(spec.shard) if spec.get("shard") is not None else None
    experiment = Experiment(name, Path(spec.get("report_dir") or f"reports/{name}"), [], shard,
                            parse_evaluation(spec.get("eval"), path), arms=arms, plan_run=plan_run,
                            imports=[Path(run) for run in spec.get("imports") or []])
    if spec.get("tune") is not None and spec.get("tuned_on") is not None:
        raise ConfigError(f"{path}: tune (a sweep trained here) and tuned_on (one trained elsewhere) exclude each "
                          "other; keep one")
    if spec.get("tune") is not None:
        key, values, steps, seeds = parse_tune(spec.tune, arms, path)
        label = TUNABLE[key]
        # The sweep's budget last, so that a train.steps on the command line sets the long budget only.
        experiment.tuning = Tuning(key, [
            plan_run(arm, seed, [f"{key}={value}", f"train.steps={steps}"], f"{arm.name}-{label}{value:g}-s{seed}",
                     runs_dir / "tune")
            for seed in seeds for arm in arms for value in values])
    else:
        experiment.runs = seed_major([(arm, seed) for arm in arms for seed in arm.seeds],
                                     lambda arm, seed: plan_run(arm, seed, [], f"{arm.name}-s{seed}"))
        if spec.get("tuned_on") is not None:
            experiment.tuning = parse_tuned_on(spec.tuned_on, path)
    return experiment
