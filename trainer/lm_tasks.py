"""lm_eval tasks by name: resolving the names (this repository's configs/eval/tasks, then lm_eval's own catalogue),
running them on an AttnResLM, and their results as metrics per task. inference.evaluate runs them on an export,
the trainer on its live model (train.eval_tasks, trainer/downstream.py).
"""
from __future__ import annotations

import difflib
import functools
from pathlib import Path

import lm_eval

from trainer.lm_eval_adapter import AttnResLM, LMEvalError

LOCAL_TASKS = Path(__file__).resolve().parents[1] / "configs" / "eval" / "tasks"


def task_manager_for(names: list[str], include_path: Path, key: str = "tasks"):
    """The lm_eval TaskManager that knows every name; an unknown name is one line naming `key`. Indexing
    lm_eval's own catalogue (some 15,000 YAMLs) takes about ten seconds, so it is read only when a name is not
    among the local tasks, and once per process (the config check and the trainer both ask)."""
    local = indexed_tasks(str(include_path), include_defaults=False)
    if all(name in local.all_tasks for name in names):
        return local
    manager = indexed_tasks(str(include_path), include_defaults=True)
    unknown = [unknown_name(name, manager.all_tasks) for name in names if name not in manager.all_tasks]
    if unknown:
        raise LMEvalError(f"{key}: unknown {', '.join(unknown)}; the local tasks in {include_path} are "
                          f"{', '.join(local.all_tasks)}, and `lm-eval ls tasks` lists lm_eval's own")
    return manager


@functools.cache
def indexed_tasks(include_path: str, include_defaults: bool):
    """lm_eval's TaskManager over include_path, with lm_eval's own tasks or without."""
    # Imported here: lm_eval's task machinery (datasets, ...) takes seconds to import, which --help, a
    # perplexity-only run and a bad-input error need not wait for (lm_eval.simple_evaluate loads it on use too).
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def unknown_name(name: str, known: list[str]) -> str:
    """`name`, with the known name it is most likely a typo of."""
    close = difflib.get_close_matches(name, known, n=1)
    return f"{name} (did you mean {close[0]}?)" if close else name


def number_or_none(value) -> float | None:
    """lm_eval writes "N/A" for a stderr it could not compute."""
    return float(value) if isinstance(value, (int, float)) else None


def task_metrics(results: dict) -> dict:
    """lm_eval's {"acc,none": value, "acc_stderr,none": stderr, ...} per task or group -> {"acc": {"value",
    "stderr"}}; a metric under a filter other than lm_eval's "none" keeps the filter: "exact_match,strict"."""
    tables = {}
    for task, entries in results["results"].items():
        metrics = {}
        for key, value in entries.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr"):
                continue
            name = metric if filter_name == "none" else key
            metrics[name] = {"value": number_or_none(value),
                             "stderr": number_or_none(entries.get(f"{metric}_stderr,{filter_name}"))}
        if metrics:  # a group that aggregates nothing has no row of its own: its tasks have theirs
            tables[task] = {"metrics": metrics, "samples": results.get("n-samples", {}).get(task, {}).get("effective")}
    return tables


def run_tasks(lm: AttnResLM, names: list[str], manager, limit: int | float | None, num_fewshot: int = 0,
              bootstrap_iters: int = 100000) -> dict:
    """task_metrics of the tasks `names` on `lm`; limit: examples per task (a fraction below 1: that share). Under
    torchrun lm_eval scores on every rank and tabulates on LOCAL_RANK 0 only: the other ranks get {}."""
    results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, num_fewshot=num_fewshot,
                                      limit=limit, log_samples=False, bootstrap_iters=bootstrap_iters)
    return {} if results is None else task_metrics(results)
