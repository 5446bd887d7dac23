"""Per-arm tuning: each arm's (model size, variant) value of one recipe key, chosen on a short sweep, and the
"each tuned" protocol that pairs every arm at its own value against the baseline at its own.

The choice is the value with the lowest final validation loss at the end of the sweep's budget, as a mean over
the seeds every value of the arm finished (the same seeds at every value: a paired mean). A choice at the lowest
or highest value tried is flagged: the optimum may lie beyond it, and the sweep should widen. The "shared"
protocol (the paper's: every arm at one value) is the report's ordinary grouping by setting.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

from scripts.report.runs import VARIANT_ORDER, Group, Run

# The recipe keys a sweep may tune, and the label the report's settings give each (runs.RECIPE).
TUNABLE = {"optim.lr": "lr", "optim.muon_lr": "muon_lr", "model.moe.bias_update_rate": "bias_rate"}
EACH_TUNED = "each tuned"


def value_of(run: Run, key: str):
    """The run's value of a dotted config key (optim.lr -> run.config.optim.lr)."""
    return functools.reduce(getattr, key.split("."), run.config)


@dataclass(frozen=True)
class Choice:
    """One arm's sweep: the mean final loss at each value over `seeds`, the value chosen, whether at an edge."""
    losses: dict[float, float]  # value -> mean final validation loss over `seeds`, by value
    seeds: tuple[int, ...]

    @property
    def value(self) -> float:
        return min(self.losses, key=self.losses.__getitem__)

    @property
    def at_edge(self) -> bool:
        return len(self.losses) > 1 and self.value in (min(self.losses), max(self.losses))


def choose(by_value: dict[float, dict[int, float]]) -> Choice | None:
    """The value with the lowest mean loss over the seeds every value has (value -> seed -> final loss); None
    when the values share no seed."""
    common = set.intersection(*(set(seeds) for seeds in by_value.values())) if by_value else set()
    if not common:
        return None
    seeds = tuple(sorted(common))
    return Choice({value: statistics.fmean(by_value[value][seed] for seed in seeds) for value in sorted(by_value)},
                  seeds)


def sweep_losses(runs: list[Run], key: str) -> dict[float, dict[int, float]]:
    """value -> seed -> final validation loss, over the runs that finished."""
    by_value: dict[float, dict[int, float]] = {}
    for run in runs:
        if run.finished and run.final_val_loss is not None:
            by_value.setdefault(value_of(run, key), {})[run.seed] = run.final_val_loss
    return by_value


def arm_of(run: Run) -> tuple[str, str]:
    return run.size, run.variant


def choices(runs: list[Run], key: str) -> dict[tuple[str, str], Choice]:
    """(model size, variant) -> its Choice over the sweep's finished runs."""
    arms = dict.fromkeys(arm_of(run) for run in runs)
    found = {arm: choose(sweep_losses([run for run in runs if arm_of(run) == arm], key)) for arm in arms}
    return {arm: choice for arm, choice in found.items() if choice is not None}


def each_tuned_groups(runs: list[Run], key: str, chosen: dict[tuple[str, str], Choice]) -> list[Group]:
    """Every arm's runs at its own chosen value, in one setting per model size ('s each tuned'), so each is
    paired with the baseline at the baseline's value."""
    groups: dict[tuple[str, str], Group] = {}
    for run in runs:
        choice = chosen.get(arm_of(run))
        if choice is not None and value_of(run, key) == choice.value:
            groups.setdefault(arm_of(run), Group(f"{run.size} {EACH_TUNED}", run.variant, [])).runs.append(run)
    for group in groups.values():
        group.runs.sort(key=lambda r: r.seed)
    return sorted(groups.values(), key=lambda g: (g.runs[0].size, VARIANT_ORDER.index(g.kind), g.block_size,
                                                  g.variant))


def tuning_section(runs: list[Run], key: str, chosen: dict[tuple[str, str], Choice]) -> list[str]:
    """The sweep's table (mean final loss per arm and value), each arm's choice, and a line per edge choice."""
    if not chosen:
        return [f"## Per-arm tuning ({key})", "", "No arm has a finished sweep yet: nothing is chosen.", ""]
    values = sorted({value for choice in chosen.values() for value in choice.losses})
    steps = sorted({run.config.train.steps for run in runs})
    lines = [f"## Per-arm tuning ({key})", "",
             f"Each arm's final validation loss after the sweep's {', '.join(map(str, steps))} steps, mean over "
             "the seeds every value of the arm finished (the same seeds at every value). The chosen value (bold) "
             f"has the lowest; the \"{EACH_TUNED}\" setting pairs every arm at its own value against the baseline "
             "at the baseline's.", "",
             f"| arm | seeds | " + " | ".join(f"{value:g}" for value in values) + " | chosen |",
             "|---|---|" + "---|" * (len(values) + 1)]
    for (size, variant), choice in chosen.items():
        cells = [("-" if value not in choice.losses else
                  f"**{choice.losses[value]:.4f}**" if value == choice.value else f"{choice.losses[value]:.4f}")
                 for value in values]
        lines.append(f"| {size} {variant} | {','.join(map(str, choice.seeds))} | " + " | ".join(cells)
                     + f" | {choice.value:g} |")
    lines.append("")
    for (size, variant), choice in chosen.items():
        if choice.at_edge:
            side = "lowest" if choice.value == min(choice.losses) else "highest"
            lines.append(f"- **{size} {variant}: the choice {choice.value:g} is the {side} value tried, so the "
                         f"optimum may lie beyond it: widen the sweep.**")
    return lines + [""]
