"""The results table: final validation loss per (setting, variant) and its paired difference to the baseline
of the same setting; and the baselines of settings that differ only in their recipe, paired against the first."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from scripts.report.runs import Group
from scripts.report.stats import Paired, holm, mean_std, paired
from scripts.report.sweeps import final_losses

PAIRED_NOTE = ("Paired: this row minus the reference at the same seed (same data order, same initial weights for "
               "the parameters both have), over the seeds both finished; mean ± sd of those differences, n, "
               "t = mean / (sd / sqrt(n)) and its 95% Student-t interval (n - 1 degrees of freedom: with n=2 the "
               "interval is 12.7 standard errors wide each side, so only a difference that both seeds agree on "
               "closely excludes 0). Negative: a lower loss than the reference. Holm: the paired t's two-sided p-value, and "
               "Holm's adjustment of it over the setting's comparisons against its baseline (m of them): the "
               "family's chance of any false 'excludes 0' is 5% where the adjusted p is below 0.05, against about "
               "one in twenty for each interval alone.")


@dataclass
class Row:
    group: Group
    loss: float | None
    loss_std: float | None
    vs_baseline: Paired | None  # this group's final loss minus its setting's baseline, seed by seed
    tokens: float
    flops: float
    step_time: float | None
    step_ratio: float | None    # step time over the baseline's
    holm: tuple[float, int] | None = None  # vs_baseline's p-value adjusted over its setting's m comparisons, m


def baseline_of(group: Group, groups: list[Group]) -> Group | None:
    return next((g for g in groups if g.size == group.size and g.variant == "baseline"), None)


def paired_groups(a: Group, b: Group) -> Paired | None:
    """a's final loss minus b's, over the seeds both finished."""
    return paired(a.final_by_seed, b.final_by_seed)


def _step_time(group: Group) -> float | None:
    times = [run.step_time for run in group.runs if run.step_time is not None]
    return statistics.fmean(times) if times else None


def build_rows(groups: list[Group]) -> list[Row]:
    rows = []
    for group in groups:
        losses = final_losses(group)
        loss, std = mean_std(losses) if losses else (None, None)
        base = baseline_of(group, groups)
        vs_baseline = paired_groups(group, base) if base is not None and base is not group else None
        step_time, base_time = _step_time(group), _step_time(base) if base is not None else None
        rows.append(Row(group, loss, std, vs_baseline,
                        tokens=statistics.fmean(run.tokens for run in group.runs),
                        flops=statistics.fmean(run.tokens * run.flops_per_token for run in group.runs),
                        step_time=step_time,
                        step_ratio=step_time / base_time if step_time and base_time else None))
    for size in dict.fromkeys(row.group.size for row in rows):
        family = [row for row in rows if row.group.size == size and row.vs_baseline and row.vs_baseline.p is not None]
        for row, adjusted in zip(family, holm([row.vs_baseline.p for row in family])):
            row.holm = adjusted, len(family)
    return rows


def _fmt(value: float | None, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def paired_cells(diff: Paired | None) -> str:
    """'mean ± sd | n | t | 95% interval | noise label' cells ('-' where there is nothing to state)."""
    if diff is None:
        return "- | - | - | - | -"
    if diff.n == 1:
        return f"{diff.mean:+.4f} | 1 | - | - | {diff.label()}"
    low, high = diff.interval
    return (f"{diff.mean:+.4f} ± {diff.sd:.4f} | {diff.n} | {diff.t:+.1f} | [{low:+.4f}, {high:+.4f}] "
            f"| {diff.label()}")


PAIRED_HEADER = "paired diff (mean ± sd) | n | t | 95% interval | noise"


def holm_cell(row: Row) -> str:
    """'p=0.0271, Holm p=0.0813 (m=3): above 0.05'; '-' where there is no p-value."""
    if row.holm is None:
        return "-"
    adjusted, m = row.holm
    return (f"p={row.vs_baseline.p:.4f}, Holm p={adjusted:.4f} (m={m}): "
            + ("below 0.05" if adjusted < 0.05 else "above 0.05"))


def to_markdown(rows: list[Row]) -> str:
    lines = [f"| setting | variant | seeds | final val loss (mean ± sd) | vs baseline: {PAIRED_HEADER} | Holm | tokens "
             "| FLOPs | s/step | step time / baseline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        unfinished = [r for r in row.group.runs if not r.finished]
        seeds = ",".join(str(r.seed) for r in row.group.runs)
        loss = _fmt(row.loss, ".4f") + (f" ± {row.loss_std:.4f}" if row.loss_std is not None else "")
        if unfinished:
            loss += f" (unfinished: {', '.join(f'{r.name} at {r.steps}/{r.config.train.steps}' for r in unfinished)})"
        lines.append(f"| {row.group.size} | {row.group.variant} | {seeds} | {loss} | {paired_cells(row.vs_baseline)} "
                     f"| {holm_cell(row)} | {row.tokens:,.0f} | {row.flops:.3g} | {_fmt(row.step_time, '.3f')} "
                     f"| {_fmt(row.step_ratio, '.2f')} |")
    return "\n".join(lines)


def recipe_lines(groups: list[Group]) -> list[str]:
    """Settings of one model size that differ only in their recipe (optimizer, learning rate, ...): each
    baseline minus the first setting's baseline, paired by seed. Empty when no model size has two."""
    baselines = [g for g in groups if g.kind == "baseline" and g.final_by_seed]
    lines = []
    for model_size in dict.fromkeys(g.model_size for g in baselines):
        reference, *others = [g for g in baselines if g.model_size == model_size]
        lines += [f"| {g.size} | {reference.size} | {paired_cells(paired_groups(g, reference))} |"
                  for g in others]
    if not lines:
        return []
    return ["## Baselines across recipes", "",
            "Each setting's baseline minus the first baseline of the same model size (paired by seed):", "",
            f"| setting | reference | {PAIRED_HEADER} |", "|---|---|---|---|---|---|---|", *lines, ""]
