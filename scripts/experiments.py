"""Comparison experiments: a grid of runs read from configs/experiment/<name>.yaml.

An experiment file holds
    seeds: [0, 1]              every run is trained once per seed (seed sets init and data order)
    shared: [train.steps=...]  trainer overrides every run gets: same data, tokens and hyperparameters
    runs:                      name + overrides (model size, variant and its options); optional seeds
      - {name: s-block, overrides: [model=s, variant=block]}
and optionally runs_dir / report_dir (default runs/<name>, reports/<name>) and
    eval: {tasks: [attnres_local], limit: 50, num_fewshot: 0}
which evaluates every finished run on those lm_eval tasks (inference.evaluate; run_dir/eval.json) for the
report's downstream table. `shard=K/N` (command line
only) keeps every N-th planned run starting at K, so N workers (processes on one machine, or jobs on
a cluster sharing the runs directory) split one experiment without training a run twice. The files are read with
OmegaConf, not composed by Hydra: they describe many trainer configs, not one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from trainer.config import CONFIG_DIR, ConfigError

EXPERIMENT_DIR = CONFIG_DIR / "experiment"
TOOL_KEYS = ("seeds", "runs_dir", "report_dir", "shard")  # command-line keys for the tool; the rest go to the trainer


@dataclass
class PlannedRun:
    name: str            # <run>-s<seed>, also the run directory's name
    run_dir: Path
    overrides: list[str]


@dataclass
class Evaluation:
    """The experiment's `eval:` block: lm_eval tasks every finished run is evaluated on."""
    tasks: list[str]
    limit: float | None = None   # examples per task (a fraction below 1: that share); None: all
    num_fewshot: int = 0


@dataclass
class Experiment:
    name: str
    report_dir: Path
    runs: list[PlannedRun]
    shard: tuple[int, int] | None = None  # (K, N): this worker trains runs K, K+N, K+2N, ... of the plan
    evaluation: Evaluation | None = None

    def my_runs(self) -> list[PlannedRun]:
        if self.shard is None:
            return self.runs
        k, n = self.shard
        return self.runs[k::n]


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


def load_experiment(name_or_path: str, overrides: list[str] = ()) -> Experiment:
    """The experiment's runs; `overrides` may set seeds / runs_dir / report_dir, the rest reach every run."""
    path = experiment_path(name_or_path)
    tool, trainer_overrides = split_overrides(list(overrides))
    spec = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(tool))
    name = path.stem
    runs_dir = Path(spec.get("runs_dir") or f"runs/{name}")
    # Seed-major order: an experiment stopped part-way holds complete comparisons for its first seeds.
    pairs = [(run, seed) for run in spec.runs for seed in run.get("seeds") or spec.seeds]
    ordered_seeds = sorted({seed for _, seed in pairs}, key=[seed for _, seed in pairs].index)
    planned = []
    for run, seed in sorted(pairs, key=lambda pair: ordered_seeds.index(pair[1])):
        run_name = f"{run.name}-s{seed}"
        run_dir = runs_dir / run_name
        planned.append(PlannedRun(run_name, run_dir, [
            *spec.get("shared", []), *run.overrides, *trainer_overrides,
            f"seed={seed}", f"run.dir={run_dir}", "resume=auto"]))
    shard = parse_shard(spec.shard) if spec.get("shard") is not None else None
    return Experiment(name, Path(spec.get("report_dir") or f"reports/{name}"), planned, shard,
                      parse_evaluation(spec.get("eval"), path))
