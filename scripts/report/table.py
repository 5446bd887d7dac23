"""The results table: final validation loss per (size, variant) against the baseline of the same size."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from scripts.report.runs import Group
from scripts.report.stats import mean_std, noise_verdict
from scripts.report.sweeps import final_losses


@dataclass
class Row:
    group: Group
    loss: float | None
    loss_std: float | None
    diff: float | None          # mean loss minus the baseline's (same size)
    verdict: str
    tokens: float
    flops: float
    step_time: float | None
    step_ratio: float | None    # step time over the baseline's


def baseline_of(group: Group, groups: list[Group]) -> Group | None:
    return next((g for g in groups if g.size == group.size and g.variant == "baseline"), None)


def _step_time(group: Group) -> float | None:
    times = [run.step_time for run in group.runs if run.step_time is not None]
    return statistics.fmean(times) if times else None


def build_rows(groups: list[Group]) -> list[Row]:
    rows = []
    for group in groups:
        losses = final_losses(group)
        loss, std = mean_std(losses) if losses else (None, None)
        base = baseline_of(group, groups)
        base_losses = final_losses(base) if base is not None else []
        diff, verdict = None, ""
        if losses and base_losses and base is not group:
            diff = loss - statistics.fmean(base_losses)
            verdict = noise_verdict(losses, base_losses)
        step_time, base_time = _step_time(group), _step_time(base) if base is not None else None
        rows.append(Row(group, loss, std, diff, verdict,
                        tokens=statistics.fmean(run.tokens for run in group.runs),
                        flops=statistics.fmean(run.tokens * run.flops_per_token for run in group.runs),
                        step_time=step_time,
                        step_ratio=step_time / base_time if step_time and base_time else None))
    return rows


def _fmt(value: float | None, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def to_markdown(rows: list[Row]) -> str:
    lines = ["| size | variant | seeds | final val loss | diff to baseline | noise | tokens | FLOPs | s/step "
             "| step time / baseline |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        unfinished = [r for r in row.group.runs if not r.finished]
        seeds = ",".join(str(r.seed) for r in row.group.runs)
        loss = _fmt(row.loss, ".4f") + (f" ± {row.loss_std:.4f}" if row.loss_std is not None else "")
        if unfinished:
            loss += f" (unfinished: {', '.join(f'{r.name} at {r.steps}/{r.config.train.steps}' for r in unfinished)})"
        lines.append(f"| {row.group.size} | {row.group.variant} | {seeds} | {loss} | {_fmt(row.diff, '+.4f')} "
                     f"| {row.verdict or '-'} | {row.tokens:,.0f} | {row.flops:.3g} | {_fmt(row.step_time, '.3f')} "
                     f"| {_fmt(row.step_ratio, '.2f')} |")
    return "\n".join(lines)
