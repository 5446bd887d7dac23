"""The token multiplier, the paper's metric: the tokens the baseline needs to reach a variant's validation
loss, divided by the tokens the variant took, at every evaluation of the variant. The baseline's tokens are
interpolated on its own curve in log tokens, seed by seed (the baseline of the same seed), then summarised
over seeds. A constant multiplier is a constant compute advantage (the paper: Block AttnRes matches a
baseline trained with 1.25x the compute); one that falls towards 1 is early-training acceleration. Beside it,
marin's compute-equivalent speedup: the baseline's compute to reach the variant's loss over the variant's
compute, which is the multiplier times the baseline's FLOPs per token over the variant's.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from scripts.report.figure import new_figure, palette, save
from scripts.report.runs import Group, Run
from scripts.report.stats import paired, t_interval
from scripts.report.table import baseline_of
from scripts.report.trend import trend, window_steps
from trainer.optim import lr_multiplier

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


def speedup_points(points: list[Point], variant: Group, base: Group) -> list[Point]:
    """The compute-equivalent speedup at the same evaluations: each seed's multiplier times the baseline's
    training FLOPs per token over the variant's (the same seed's runs)."""
    ratio = {run.seed: next(b for b in base.runs if b.seed == run.seed).flops_per_token / run.flops_per_token
             for run in variant.runs if any(b.seed == run.seed for b in base.runs)}
    return [Point(p.step, p.tokens, {seed: value if isinstance(value, str) else value * ratio[seed]
                                     for seed, value in p.by_seed.items()}, p.decay) for p in points]


def decay_rule(base: Group) -> str:
    """Where the † rule falls in this setting, as multiplier_points applies it: the first evaluation that
    follows an update of the LR decay, and the baseline's last evaluation before it (matched tokens past it
    are interpolated towards an evaluation in the decay)."""
    run = base.runs[0]
    train = run.config.train
    first_decay = next((u for u in range(train.warmup_steps, train.steps) if lr_multiplier(u, train) < 1), None)
    stable = [r for r in run.evaluations if not run.in_decay(r["step"])]
    if first_decay is None or not stable:
        return f"{DECAY_MARK}: none here (no evaluation lies in an LR decay)."
    last = stable[-1]
    return (f"{DECAY_MARK} here: the variant's evaluation follows an update of the LR decay (the decay's updates "
            f"start at step {first_decay + 1}, so every evaluation after step {first_decay} is marked), or the "
            f"baseline tokens matched exceed {last['tokens'] / 1e6:.2f}M, the baseline's last evaluation before "
            f"its decay (step {last['step']}), so they are interpolated towards an evaluation in the decay.")


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
             "lie in an LR decay, where the loss falls for the schedule's sake as well as the tokens' (each "
             "setting says where that falls). The compute-equivalent speedup (marin's) is the baseline's compute "
             "to reach the variant's loss over the variant's compute: the multiplier times the baseline's "
             "training FLOPs per token over the variant's. The trend below each table takes one window for every "
             "variant of the setting: the evaluations before the decay where every variant and seed has a "
             "multiplier. Per seed a least-squares line against log2 tokens, its slope per doubling of tokens "
             "± its standard error; the measured means at the window's first, middle and last evaluation beside "
             "the line's ends. A slope of 0 is a constant advantage, a negative one a shrinking one. A line that "
             "a bend in log tokens fits better (F-test, 5%) is said to fit poorly; an interval across seeds is "
             "labelled only with 3 seeds or more.", "",
             f"![token multiplier]({figure.name})", ""]
    for setting, by_variant in curves.items():
        steps = next(g for g in groups if g.size == setting).runs[0].config.train.steps
        columns = at_budget(next(iter(by_variant.values())), steps)
        header = (" | ".join(f"{fraction:.0%} (step {p.step}, {p.tokens / 1e6:.2f}M tokens)"
                             for fraction, p in zip(BUDGET_FRACTIONS, columns)))
        table_head = [f"| variant | {header} |", "|---|" + "---|" * len(BUDGET_FRACTIONS)]

        def rows(text_of) -> list[str]:
            return [f"| {variant} | " + " | ".join(cell(text_of(variant, p), p, column)
                                                  for p, column in zip(at_budget(points, steps), columns)) + " |"
                    for variant, points in by_variant.items()]

        base = pairs[(setting, next(iter(by_variant)))][1]
        speedups = {variant: {p.step: p for p in speedup_points(points, *pairs[(setting, variant)])}
                    for variant, points in by_variant.items()}
        lines += [f"**{setting}**", "", decay_rule(base), "", *table_head,
                  *rows(lambda variant, p: p.text()),
                  "", "Compute-equivalent speedup at the same evaluations:", "", *table_head,
                  *rows(lambda variant, p: speedups[variant][p.step].text())]
        window = window_steps(by_variant)
        trends = [(variant, trend(points, window)) for variant, points in by_variant.items()]
        if any(found for _, found in trends):
            lines += ["", "The multiplier's trend before the LR decay, over one window for every variant:", ""]
            lines += [f"- {variant}: {found.text()}" for variant, found in trends if found]
        lines += ["", "Validation loss minus the baseline's at the same evaluations (paired by seed, mean ± sd: "
                      "the noise label of its 95% interval):", "", *table_head,
                  *rows(lambda variant, p: difference_text(*pairs[(setting, variant)], p.step)), ""]
    return lines
