"""The token multiplier, the paper's metric: the tokens the baseline needs to reach a variant's validation
loss, divided by the tokens the variant took, at every evaluation of the variant. The baseline's tokens are
interpolated on its own curve in log tokens, seed by seed (the baseline of the same seed), then summarised
over seeds. A constant multiplier is a constant compute advantage (the paper: Block AttnRes matches a
baseline trained with 1.25x the compute); one that falls towards 1 is early-training acceleration.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from scripts.report.figure import new_figure, palette, save
from scripts.report.runs import Group, Run
from scripts.report.stats import interval_label, paired, t_interval
from scripts.report.table import baseline_of

BEYOND = "beyond the baseline's curve"
BEFORE = "before the baseline's first evaluation"
BUDGET_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
PAPER_MULTIPLIER = 1.25
DECAY_MARK = "†"


def baseline_tokens_to_reach(curve: list[tuple[int, float]], loss: float) -> float | str:
    """The tokens at which the (tokens, loss) curve first reaches `loss`, linear in log tokens between the
    two evaluations around that crossing. BEYOND when it never does (no extrapolation); BEFORE when its
    first evaluation is already lower (it got there at fewer tokens than it was evaluated at)."""
    points = [(tokens, value) for tokens, value in curve if tokens > 0]
    if not points:
        return BEYOND
    first_tokens, first_loss = points[0]
    if first_loss <= loss:
        return first_tokens if first_loss == loss else BEFORE
    # Every earlier evaluation is above `loss`, so the first one at or below it closes the first crossing.
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if l1 <= loss:
            fraction = (l0 - loss) / (l0 - l1)
            return math.exp(math.log(t0) + fraction * (math.log(t1) - math.log(t0)))
    return BEYOND


def stable_tokens(run: Run) -> int:
    """The tokens of the run's last evaluation before its LR decay (0 when every one is in it)."""
    return max((r["tokens"] for r in run.evaluations if not run.in_decay(r["step"])), default=0)


@dataclass
class Point:
    """One evaluation of a variant: its tokens, and per seed the multiplier or why there is none."""
    step: int
    tokens: int
    by_seed: dict[int, float | str]
    decay: bool  # the variant's evaluation, or the baseline tokens matched, lie in an LR decay

    @property
    def values(self) -> list[float]:
        return [value for value in self.by_seed.values() if not isinstance(value, str)]

    @property
    def complete(self) -> bool:
        return len(self.values) == len(self.by_seed)

    def text(self) -> str:
        """'1.32 ± 0.05 [1.10, 1.54]' (mean ± sd over seeds, 95% interval), '1.32 (n=1)', or where a seed
        has no multiplier, why, with its seeds."""
        mark = f" {DECAY_MARK}" if self.decay else ""
        if not self.complete:
            reasons = {}
            for seed, value in self.by_seed.items():
                reasons.setdefault(value if isinstance(value, str) else f"{value:.2f}", []).append(str(seed))
            return "; ".join(f"{reason} (seed {', '.join(seeds)})" for reason, seeds in reasons.items()) + mark
        if len(self.values) == 1:
            return f"{self.values[0]:.2f} (n=1){mark}"
        low, high = t_interval(self.values)
        return f"{statistics.fmean(self.values):.2f} ± {statistics.stdev(self.values):.2f} [{low:.2f}, {high:.2f}]{mark}"


def multiplier_points(variant: Group, base: Group) -> list[Point]:
    """Every evaluation of the variant's runs, each seed against the baseline's run of the same seed."""
    bases = {run.seed: run for run in base.runs if run.val_curve}
    runs = [run for run in variant.runs if run.seed in bases]
    points: dict[int, Point] = {}
    for run in runs:
        baseline = bases[run.seed]
        for record in run.evaluations:
            if record["tokens"] <= 0:
                continue
            needed = baseline_tokens_to_reach(baseline.val_curve, record["val_loss"])
            point = points.setdefault(record["step"], Point(record["step"], record["tokens"], {}, False))
            point.by_seed[run.seed] = needed if isinstance(needed, str) else needed / record["tokens"]
            point.decay |= run.in_decay(record["step"]) or (not isinstance(needed, str)
                                                           and needed > stable_tokens(baseline))
    return [points[step] for step in sorted(points)]


@dataclass(frozen=True)
class Trend:
    """Whether the multiplier falls towards 1 or settles: per seed, a least-squares line of the multiplier
    against log2 tokens over the evaluations before any LR decay where every seed has one. Its slope is the
    change per doubling of tokens: the paper's constant advantage is 0, early acceleration alone negative.
    The line's ends stand in for the first and last single evaluation, which are as noisy as any other."""
    first: Point
    last: Point
    evaluations: int
    lines: dict[int, tuple[float, float]]  # seed -> (slope per doubling, intercept at 1 token)

    def fitted(self, tokens: int) -> float:
        """The seeds' mean line at `tokens`."""
        return statistics.fmean(slope * math.log2(tokens) + intercept for slope, intercept in self.lines.values())

    def text(self) -> str:
        """'steps 50-700 (14 evaluations): the line runs from 1.31 at 0.05M tokens to 1.15 at 0.72M; per
        doubling -0.044 ± 0.001 [-0.054, -0.034]: falling on every seed, interval excludes 0'."""
        slopes = [slope for slope, _ in self.lines.values()]
        spread = ""
        if len(slopes) > 1:
            low, high = t_interval(slopes)
            spread = f" ± {statistics.stdev(slopes):.3f} [{low:+.3f}, {high:+.3f}]"
        return (f"steps {self.first.step}-{self.last.step} ({self.evaluations} evaluations): the line runs from "
                f"{self.fitted(self.first.tokens):.2f} at {self.first.tokens / 1e6:.2f}M tokens to "
                f"{self.fitted(self.last.tokens):.2f} at {self.last.tokens / 1e6:.2f}M; per doubling "
                f"{statistics.fmean(slopes):+.3f}{spread}: " + interval_label(slopes, below="falling", above="rising"))


def trend(points: list[Point]) -> Trend | None:
    """The multiplier's Trend over `points`' complete evaluations before any decay; None with fewer than 3."""
    stable = [p for p in points if p.complete and not p.decay]
    if len(stable) < 3:
        return None
    log_tokens = [math.log2(p.tokens) for p in stable]
    lines = {seed: tuple(statistics.linear_regression(log_tokens, [p.by_seed[seed] for p in stable]))
             for seed in stable[0].by_seed}
    return Trend(stable[0], stable[-1], len(stable), lines)


def at_budget(points: list[Point], steps: int) -> list[Point]:
    """The evaluation nearest each BUDGET_FRACTIONS of `steps`."""
    return [min(points, key=lambda p: abs(p.step - fraction * steps)) for fraction in BUDGET_FRACTIONS]


def loss_at(group: Group, step: int) -> dict[int, float]:
    """seed -> validation loss at the evaluation after `step` updates, over the runs that have one."""
    return {run.seed: r["val_loss"] for run in group.runs for r in run.evaluations if r["step"] == step}


def difference_text(variant: Group, base: Group, step: int) -> str:
    """The variant's validation loss minus the baseline's at `step`, paired by seed, with its label."""
    diff = paired(loss_at(variant, step), loss_at(base, step))
    if diff is None:
        return "-"
    spread = f" ± {diff.sd:.4f}" if diff.sd is not None else ""
    return f"{diff.mean:+.4f}{spread}: {diff.label()}"


def cell(text: str, point: Point, column: Point) -> str:
    """A table cell, naming its step when this variant was evaluated at another step than the column's."""
    return text if point.step == column.step else f"{text} (step {point.step})"


def multiplier_figure(curves: dict[str, dict[str, list[Point]]], path: Path) -> Path:
    """One panel per setting, one line per variant: the mean multiplier over seeds at every evaluation where
    every seed has one; hollow markers for points in an LR decay."""
    fig, axes = new_figure(panels=len(curves), width=6, height=4, columns=2)
    colors = palette([variant for by_variant in curves.values() for variant in by_variant])
    for ax, (setting, by_variant) in zip(axes, curves.items()):
        for variant, points in by_variant.items():
            drawn = [p for p in points if p.complete]
            if not drawn:
                continue
            means = [statistics.fmean(p.values) for p in drawn]
            ax.plot([p.tokens for p in drawn], means, color=colors[variant], label=variant)
            ax.scatter([p.tokens for p in drawn], means, color=colors[variant], zorder=3,
                       facecolors=["white" if p.decay else colors[variant] for p in drawn])
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.axhline(PAPER_MULTIPLIER, color="gray", linestyle=":", linewidth=0.8, label="the paper's 1.25x (Block)")
        ax.set(xscale="log", xlabel="variant's training tokens", ylabel="baseline tokens / variant tokens",
               title=f"{setting}: token multiplier (hollow: LR decay)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return save(fig, path)


def multiplier_section(groups: list[Group], out_dir: Path) -> list[str]:
    """The figure and, per setting, the multiplier and the paired loss difference at 25/50/75/100% of the
    budget."""
    curves: dict[str, dict[str, list[Point]]] = {}
    pairs: dict[tuple[str, str], tuple[Group, Group]] = {}
    for group in groups:
        base = baseline_of(group, groups)
        if base is None or base is group:
            continue
        points = multiplier_points(group, base)
        if points:
            curves.setdefault(group.size, {})[group.variant] = points
            pairs[(group.size, group.variant)] = group, base
    if not curves:
        return []
    figure = multiplier_figure(curves, out_dir / "token_multiplier.png")
    lines = ["## Token multiplier (the paper's metric)", "",
             "Baseline tokens to reach the variant's validation loss / the variant's tokens, per seed against the "
             "baseline of the same seed, interpolated linearly in log tokens between the baseline's two "
             "evaluations around its first crossing of that loss; mean ± sd over seeds [95% Student-t interval]. "
             "1 is no advantage; the paper's Block AttnRes matches a baseline trained with 1.25x the compute. "
             f"{BEYOND[0].upper() + BEYOND[1:]}: the baseline never reaches that loss in its run (no "
             f"extrapolation). {DECAY_MARK}: the variant's evaluation, or the baseline tokens it is matched to, "
             "lie in an LR decay, where the loss falls for the schedule's sake as well as the tokens'. The trend "
             "below each table takes the evaluations before the decay where every seed has a multiplier: per seed a "
             "least-squares line against log2 tokens; the seeds' mean line at the first and last of them, and its "
             "slope per doubling of tokens, mean ± sd [95% interval]. A slope of 0 is a constant advantage, a "
             "negative one a shrinking one.", "",
             f"![token multiplier]({figure.name})", ""]
    for setting, by_variant in curves.items():
        steps = next(g for g in groups if g.size == setting).runs[0].config.train.steps
        some = at_budget(next(iter(by_variant.values())), steps)
        header = " | ".join(f"{fraction:.0%} (step {p.step}, {p.tokens / 1e6:.2f}M tokens)"
                            for fraction, p in zip(BUDGET_FRACTIONS, some))
        lines += [f"**{setting}**", "", f"| variant | {header} |", "|---|" + "---|" * len(BUDGET_FRACTIONS)]
        lines += [f"| {variant} | " + " | ".join(cell(p.text(), p, column)
                                                for p, column in zip(at_budget(points, steps), some)) + " |"
                  for variant, points in by_variant.items()]
        trends = [(variant, trend(points)) for variant, points in by_variant.items()]
        if any(found for _, found in trends):
            lines += ["", "The multiplier's trend before the LR decay:", ""]
            lines += [f"- {variant}: {found.text()}" for variant, found in trends if found]
        lines += ["", f"Validation loss minus the baseline's at the same evaluations (paired by seed, mean ± sd: "
                      "the noise label of its 95% interval):", "",
                  f"| variant | {header} |", "|---|" + "---|" * len(BUDGET_FRACTIONS)]
        lines += [f"| {variant} | " + " | ".join(cell(difference_text(*pairs[(setting, variant)], p.step), p, column)
                                                for p, column in zip(at_budget(points, steps), some)) + " |"
                  for variant, points in by_variant.items()]
        lines.append("")
    return lines
