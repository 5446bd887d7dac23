"""The downstream table: lm_eval task metrics per variant (each run's eval.json, which the comparison tool
writes when the experiment sets `eval.tasks`), with each variant's paired difference to its baseline."""
from __future__ import annotations

from scripts.report.runs import Group
from scripts.report.stats import mean_std, paired
from scripts.report.table import baseline_of


def scores(group: Group, task: str, metric: str) -> dict[int, tuple[float, float | None]]:
    """seed -> (value, lm_eval's stderr) of one metric over the group's evaluated runs."""
    return {run.seed: run.evaluation[task][metric] for run in group.runs
            if metric in run.evaluation.get(task, {})}


def value_text(by_seed: dict[int, tuple[float, float | None]]) -> str:
    """One seed: the value ± lm_eval's stderr over the examples; several: the mean ± the std over seeds."""
    if len(by_seed) == 1:
        value, stderr = next(iter(by_seed.values()))
        return f"{value:.4f}" + ("" if stderr is None else f" ± {stderr:.4f} (stderr)")
    mean, sd = mean_std([value for value, _ in by_seed.values()])
    return f"{mean:.4f} ± {sd:.4f} ({len(by_seed)} seeds)"


def diff_text(by_seed: dict, base_by_seed: dict) -> str:
    diff = paired({seed: value for seed, (value, _) in by_seed.items()},
                  {seed: value for seed, (value, _) in base_by_seed.items()})
    # The text without the noise label: its "ahead" means a lower loss, and task metrics are higher-better.
    return diff.text() if diff is not None else "-"


def metrics_in(groups: list[Group]) -> list[tuple[str, str]]:
    """(task, metric) pairs in the order the runs report them."""
    found = {}
    for group in groups:
        for run in group.runs:
            for task, metrics in run.evaluation.items():
                for metric in metrics:
                    found[(task, metric)] = None
    return list(found)


def downstream_section(groups: list[Group]) -> list[str]:
    pairs = metrics_in(groups)
    if not pairs:
        return []
    rows = []
    for task, metric in pairs:
        for group in groups:
            by_seed = scores(group, task, metric)
            if not by_seed:
                continue
            base = baseline_of(group, groups)
            diff = "-" if base is None or base is group else diff_text(by_seed, scores(base, task, metric))
            rows.append(f"| {task} | {metric} | {group.size} | {group.variant} | {value_text(by_seed)} | {diff} |")
    return ["## Downstream tasks", "",
            "lm_eval on each run's final weights (`inference.evaluate`; the experiment's `eval.tasks`). A paired "
            "difference is the variant minus its baseline, seed by seed.",
            "", "| task | metric | size | variant | value | paired diff to baseline |", "|---|---|---|---|---|---|",
            *rows, ""]
