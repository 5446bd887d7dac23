"""Read finished (or unfinished) run directories: config.yaml, metrics.jsonl (training rows, and the lm_eval
task rows of train.eval_tasks), diagnostics.jsonl, and eval.json when the comparison tool evaluated the run
(inference.evaluate's results).

Runs are grouped by (setting, residual variant) read from their resolved config, so the report
works the same on runs the comparison tool trained and on run directories copied from a cluster. The
setting is the model size plus every recipe field (RECIPE) that differs between the runs of a report:
an LR sweep's groups are `s lr=0.001`, `s lr=0.003`, ..., each compared with the baseline of its own
setting.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from model.config import ModelConfig, ResidualConfig
from model.flops import training_flops_per_token
from model.residual import DepthGeometry
from trainer.config import CONFIG_DIR, Config, with_current_names
from trainer.optim import lr_multiplier

EVAL_FILE = "eval.json"
VARIANT_ORDER = ("baseline", "highway", "x0", "full", "block", "mhc", "hc")
# Residual options that change what the model computes; two_phase is an exact rewrite, not a variant.
OPTIONS = ("query", "kernel", "key_norm", "mixing", "heads", "window")
# Recipe fields a comparison may vary on purpose (learning-rate sweeps, the optimizer, the old-initialisation
# control). Muon's learning rate means nothing to an AdamW run, so it has none ("-") and its label omits it.
RECIPE = {"lr": lambda cfg: cfg.optim.lr, "optim": lambda cfg: cfg.optim.name,
          "muon_lr": lambda cfg: cfg.optim.muon_lr if cfg.optim.name == "muon" else "-",
          "init": lambda cfg: cfg.model.init, "bias_rate": lambda cfg: cfg.model.moe.bias_update_rate}


def read_jsonl(path: Path, problem=lambda row: None) -> list[dict]:
    """The rows of a JSON-lines file ([] when there is none). A last line that does not parse is a
    run killed mid-write: skipped with a warning. A bad line anywhere else, or a row that parses but
    that `problem(row)` describes as unusable, is an error naming the file and line."""
    if not path.is_file():
        return []
    numbered = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows = []
    for number, line in numbered:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == numbered[-1][0]:
                print(f"warning: {path}:{number}: skipped a truncated last line (a run killed mid-write)",
                      file=sys.stderr)
                continue
            raise ValueError(f"{path}:{number}: not a JSON line ({error.msg}, column {error.colno}); "
                             "fix or delete that line") from None
        if (reason := problem(row)) is not None:
            raise ValueError(f"{path}:{number}: {reason}; fix or delete that line")
        rows.append(row)
    return rows


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# What the report reads from a training row (one with a loss): key -> (test, what is allowed, required).
TRAINING_FIELDS = {
    "step": (_count, "a whole number >= 0", True),
    "tokens": (_count, "a whole number >= 0", True),
    "step_time_s": (lambda v: _number(v) and 0 <= v < math.inf, "a finite number of seconds >= 0", True),
    "loss": (lambda v: v is None or _number(v), "a number or null", True),
    "val_loss": (lambda v: v is None or _number(v), "a number or null", False),
    "moe_load_imbalance": (lambda v: v is None or _number(v), "a number or null", False),
}


def _row_problem(row, fields: dict) -> str | None:
    """Why `row` is no row the report can read (None when it is): not an object, or a field of `fields`
    missing or of the wrong kind."""
    if not isinstance(row, dict):
        return f"{json.dumps(row)} is not a JSON object"
    for key, (allowed, what, required) in fields.items():
        if key not in row:
            if required:
                return f"no {key} ({what})"
        elif not allowed(row[key]):
            return f"{key}={json.dumps(row[key])} is not {what}"
    return None


# train.eval_tasks' rows: eval/<task>/<metric> keys at a step, which the trainer writes after the step's own row.
TASK_PREFIX = "eval/"
TASK_FIELDS = {key: TRAINING_FIELDS[key] for key in ("step", "tokens")}


def is_task_row(row) -> bool:
    return isinstance(row, dict) and "loss" not in row and any(key.startswith(TASK_PREFIX) for key in row)


def metrics_problem(row) -> str | None:
    """metrics.jsonl: training rows (with a loss) and task rows hold what the report reads; other rows are
    passed over."""
    if is_task_row(row):
        bad = next((key for key, value in row.items() if key.startswith(TASK_PREFIX)
                    and not (value is None or _number(value))), None)
        return f"{bad}={json.dumps(row[bad])} is not a number or null" if bad else _row_problem(row, TASK_FIELDS)
    return _row_problem(row, TRAINING_FIELDS if isinstance(row, dict) and "loss" in row else {})


def diagnostics_problem(row) -> str | None:
    return _row_problem(row, {"step": TRAINING_FIELDS["step"]})


def read_run_config(path: Path) -> Config:
    """A run directory's config.yaml as a Config; a malformed one is an error naming the file (and line)."""
    file = path / "config.yaml"
    try:
        saved = with_current_names(OmegaConf.to_container(OmegaConf.load(file)))
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), saved))
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{file}:{mark.line + 1}" if mark is not None else str(file)
        raise ValueError(f"{where}: not valid YAML ({error.problem or error.context}); fix it or leave this run "
                         "out of the report") from None
    except (yaml.YAMLError, OmegaConfBaseException, OSError) as error:
        key = f"{error.full_key}: " if getattr(error, "full_key", None) else ""
        raise ValueError(f"{file}: not a config of this trainer ({key}{str(error).splitlines()[0]}); fix it or "
                         "leave this run out of the report") from None


def measured(value) -> bool:
    """A logged number that is there: null is what the trainer writes for NaN or infinity (older
    runs wrote a bare NaN, which Python reads as a float nan)."""
    return value is not None and math.isfinite(value)


def by_step(records: list[dict]) -> list[dict]:
    """One record per step, the last one written: a resumed run re-logs the steps after its checkpoint."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def _shape(model: ModelConfig) -> dict:
    shape = dataclasses.asdict(model)
    for key in ("residual", "kernel_impl", "init", "init_std", "norm_eps"):
        shape.pop(key)
    for key in ("bias_update_rate", "aux_loss_coef"):  # balancing recipe, not the model's shape
        shape["moe"].pop(key)
    return shape


@functools.cache
def known_shapes() -> tuple[tuple[str, dict], ...]:
    """(name, shape) of every configs/model/ file, read once: merging them is most of a report's load time. A
    preset's Hydra defaults list (model=kimi_k3 picks its variant) is no shape."""
    presets = {path.stem: OmegaConf.load(path) for path in sorted((CONFIG_DIR / "model").glob("*.yaml"))}
    for values in presets.values():
        values.pop("defaults", None)
    return tuple((name, _shape(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))))
                 for name, values in presets.items())


def size_name(model: ModelConfig) -> str:
    """The configs/model/ name with this shape (xs, s, ...), else d<width>xL<blocks>. A known shape with another
    count of dense blocks is that name plus 'dense' (every block dense: the dense-vs-MoE control) or
    'n_dense_layers=K'."""
    shape = _shape(model)
    for name, known in known_shapes():
        if known == shape:
            return name
        if known == {**shape, "n_dense_layers": known["n_dense_layers"]}:
            dense = model.n_dense_layers
            return f"{name} " + ("dense" if dense == model.n_blocks else f"n_dense_layers={dense}")
    return f"d{model.d_model}xL{model.n_blocks}"


def variant_label(model: ModelConfig, with_block_size: bool = True) -> str:
    """'baseline', 'full', 'block S=2', 'mhc m=4', 'denseformer', plus every option that differs from its default."""
    r, default = model.residual, ResidualConfig()
    if r.kind == "full" and r.mixing == "scalars":
        return "denseformer"  # the preset (configs/variant/denseformer.yaml)
    block = f"block S={DepthGeometry.of(model).size}" if with_block_size else "block"
    label = {"block": block, "mhc": f"mhc m={r.streams}", "hc": f"hc m={r.streams}",
             "highway": "highway" + (f" gate={r.gate}" if r.gate != default.gate else "")}.get(r.kind, r.kind)
    if r.kind in ("full", "block"):
        label += "".join(f" {key}={getattr(r, key)}" for key in OPTIONS if getattr(r, key) != getattr(default, key))
    return label


@dataclass
class Run:
    path: Path
    config: Config
    metrics: list[dict]       # one training record per logged step
    diagnostics: list[dict]   # one record per diag_every steps
    task_rows: list[dict] = field(default_factory=list)  # train.eval_tasks' scores, one record per evaluated step

    @classmethod
    def load(cls, path: str | Path) -> "Run":
        path = Path(path)
        if not (path / "config.yaml").is_file():
            raise FileNotFoundError(f"{path} is not a run directory (no config.yaml)")
        config = read_run_config(path)
        rows = read_jsonl(path / "metrics.jsonl", metrics_problem)
        return cls(path, config, by_step([r for r in rows if "loss" in r]),
                   by_step(read_jsonl(path / "diagnostics.jsonl", diagnostics_problem)),
                   by_step([r for r in rows if is_task_row(r)]))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def seed(self) -> int:
        return self.config.seed

    @cached_property
    def size(self) -> str:
        return size_name(self.config.model)

    @property
    def variant(self) -> str:
        return variant_label(self.config.model)

    @property
    def family(self) -> str:
        """The variant across model sizes: the default Block (about 8 blocks) has a different S per size."""
        return variant_label(self.config.model, with_block_size=self.config.model.residual.block_size is not None)

    @property
    def steps(self) -> int:
        return self.metrics[-1]["step"] if self.metrics else 0

    @property
    def finished(self) -> bool:
        return self.steps >= self.config.train.steps

    @property
    def evaluations(self) -> list[dict]:
        """The training records of every evaluation with a finite validation loss."""
        return [r for r in self.metrics if measured(r.get("val_loss"))]

    @property
    def val_curve(self) -> list[tuple[int, float]]:
        """(tokens, validation loss) at every evaluation with a finite loss."""
        return [(r["tokens"], r["val_loss"]) for r in self.evaluations]

    def in_decay(self, step: int) -> bool:
        """Whether the evaluation after `step` updates follows updates of the LR decay (past warm-up, below
        the peak), where the loss falls for the schedule's sake as well as for the tokens'."""
        last_update = step - 1
        return last_update >= self.config.train.warmup_steps and lr_multiplier(last_update, self.config.train) < 1

    @property
    def final_val_loss(self) -> float | None:
        curve = self.val_curve
        return curve[-1][1] if curve else None

    @property
    def tokens(self) -> int:
        return self.metrics[-1]["tokens"] if self.metrics else 0

    def recipe(self, keys: list[str]) -> str:
        """'lr=0.001 init=flat' for the given RECIPE keys ('' for none); a field this run has none of ("-")
        is left out, so an AdamW control in a Muon sweep reads 'optim=adamw'."""
        values = {key: RECIPE[key](self.config) for key in keys}
        values = {key: value for key, value in values.items() if value != "-"}
        return " ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in values.items())

    @property
    def task_curves(self) -> dict[str, list[tuple[int, float]]]:
        """"<task>/<metric>" -> (tokens, value) at every step train.eval_tasks scored it."""
        curves: dict[str, list[tuple[int, float]]] = {}
        for row in self.task_rows:
            for key, value in row.items():
                if key.startswith(TASK_PREFIX) and measured(value):
                    curves.setdefault(key.removeprefix(TASK_PREFIX), []).append((row["tokens"], value))
        return curves

    @property
    def moe_curve(self) -> list[tuple[int, float]]:
        """(step, max/mean expert load) at every logged step of an MoE model."""
        return [(r["step"], r["moe_load_imbalance"]) for r in self.metrics if measured(r.get("moe_load_imbalance"))]

    @property
    def step_time(self) -> float | None:
        """Median seconds per step, leaving out step 1 (warm-up)."""
        times = [r["step_time_s"] for r in self.metrics if r["step"] > 1] or [r["step_time_s"] for r in self.metrics]
        return statistics.median(times) if times else None

    @cached_property
    def flops_per_token(self) -> float:
        return training_flops_per_token(self.config.model, self.config.train.seq_len)["total"]

    @property
    def final_diagnostics(self) -> dict | None:
        return self.diagnostics[-1] if self.diagnostics else None

    @cached_property
    def evaluation(self) -> dict[str, dict[str, tuple[float, float | None]]]:
        """eval.json's task metrics, {task: {metric: (value, stderr)}}; empty when the run was not evaluated."""
        path = self.path / EVAL_FILE
        if not path.is_file():
            return {}
        try:
            tasks = json.loads(path.read_text())["tasks"]
            return {task: {metric: (float(measured["value"]), measured["stderr"])
                           for metric, measured in entry["metrics"].items() if measured["value"] is not None}
                    for task, entry in tasks.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{path} is not inference.evaluate's results ({error!r}); delete it to evaluate again") \
                from None

    @cached_property
    def depth_matrix(self) -> dict | None:
        """depth_matrix/depth_matrix.json (scripts.depth_matrix on the run's newest checkpoint), if written."""
        path = self.path / "depth_matrix" / "depth_matrix.json"
        return json.loads(path.read_text()) if path.is_file() else None


@dataclass
class Group:
    """The seeds of one (setting, variant); the setting is the model size plus any varied recipe."""
    size: str
    variant: str
    runs: list[Run]

    @property
    def model_size(self) -> str:
        return self.runs[0].size

    @property
    def final_by_seed(self) -> dict[int, float]:
        """seed -> final validation loss, over the finished runs that have one: an unfinished run's last
        evaluation is at another step than a finished run's, so pairing the two would compare budgets."""
        return {run.seed: run.final_val_loss for run in self.runs
                if run.finished and run.final_val_loss is not None}

    @property
    def lr(self) -> float:
        return self.runs[0].config.optim.lr

    @property
    def kind(self) -> str:
        return self.runs[0].config.model.residual.kind

    @property
    def block_size(self) -> int:
        """Sublayers per depth block; 0 for variants that do not attend over depth."""
        return DepthGeometry.of(self.runs[0].config.model).size or 0

    @property
    def is_plain_block(self) -> bool:
        """Block AttnRes with every option at its default (a point of the block-size sweep)."""
        return self.kind == "block" and self.variant == f"block S={self.block_size}"

    def sort_key(self) -> tuple:
        config = self.runs[0].config
        return (config.model.d_model, config.model.n_blocks, config.model.init, config.optim.lr,
                VARIANT_ORDER.index(self.kind), self.block_size, self.variant)


def varied_recipe(runs: list[Run]) -> list[str]:
    """The RECIPE keys whose values differ between runs."""
    return [key for key, value_of in RECIPE.items() if len({value_of(run.config) for run in runs}) > 1]


def group_runs(runs: list[Run]) -> list[Group]:
    varied = varied_recipe(runs)
    groups: dict[tuple[str, str], Group] = {}
    for run in runs:
        setting = " ".join(filter(None, (run.size, run.recipe(varied))))
        groups.setdefault((setting, run.variant), Group(setting, run.variant, [])).runs.append(run)
    for group in groups.values():
        group.runs.sort(key=lambda r: r.seed)
    return sorted(groups.values(), key=Group.sort_key)
