"""Whether the token multiplier falls towards 1 or settles: per seed, a least-squares line of the multiplier
against log2 tokens, over one window of evaluations shared by every variant of a setting (before any LR decay,
where every variant and seed has a multiplier), so that the variants' slopes describe the same tokens.

The slope is the change per doubling of tokens: the paper's constant advantage is 0, early acceleration alone
negative. Each seed's slope comes with its standard error from the line's residuals. A line is said to fit
poorly where a bend in log tokens explains a seed's curve better than the line (an F-test of the quadratic term
at 5%): then the slope averages a steep early fall with a flat tail, and the measured values, which the text
gives at the window's first, middle and last evaluation, say more than it. An interval across seeds is labelled
only with 3 seeds or more and a line that fits: with 2 it has 1 degree of freedom.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

from scripts.report.stats import interval_label, t_interval

BEND_P = 0.05
MIN_SEEDS_FOR_LABEL = 3


@dataclass(frozen=True)
class SeedLine:
    """One seed's least-squares line of the multiplier against log2 tokens."""
    slope: float            # per doubling of tokens
    intercept: float        # at 1 token
    slope_se: float | None  # from the residuals (k - 2 degrees of freedom); None with 2 evaluations
    bend_p: float | None    # F-test of a quadratic term in log2 tokens; None with fewer than 4 evaluations

    @classmethod
    def fit(cls, log_tokens: list[float], values: list[float]) -> "SeedLine":
        x, y = np.array(log_tokens), np.array(values)
        k = len(x)
        slope, intercept = statistics.linear_regression(log_tokens, values)
        line_ssr = float(np.sum((y - (slope * x + intercept)) ** 2))
        spread = float(np.sum((x - x.mean()) ** 2))
        slope_se = math.sqrt(line_ssr / (k - 2) / spread) if k > 2 else None
        bend_p = None
        if k > 3:
            bend_ssr = float(np.sum((y - np.polyval(np.polyfit(x, y, 2), x)) ** 2))
            exact = 1e-20 * (float(np.sum((y - y.mean()) ** 2)) + 1e-10)  # rounding, not residuals
            if line_ssr <= exact:
                bend_p = 1.0
            elif bend_ssr <= exact:
                bend_p = 0.0
            else:
                f = (line_ssr - bend_ssr) / (bend_ssr / (k - 3))
                bend_p = float(scipy_stats.f.sf(f, 1, k - 3))
        return cls(slope, intercept, slope_se, bend_p)

    @property
    def bends(self) -> bool:
        return self.bend_p is not None and self.bend_p < BEND_P


@dataclass(frozen=True)
class Trend:
    """The multiplier's lines over one window of evaluations (points of one variant, every one complete)."""
    window: list  # the variant's Points in the window, in token order
    lines: dict[int, SeedLine]

    @property
    def first(self):
        return self.window[0]

    @property
    def last(self):
        return self.window[-1]

    @property
    def evaluations(self) -> int:
        return len(self.window)

    @property
    def middle(self):
        """The evaluation nearest the window's middle in log tokens."""
        centre = (math.log2(self.first.tokens) + math.log2(self.last.tokens)) / 2
        return min(self.window, key=lambda p: abs(math.log2(p.tokens) - centre))

    def fitted(self, tokens: int) -> float:
        """The seeds' mean line at `tokens`."""
        return statistics.fmean(line.slope * math.log2(tokens) + line.intercept for line in self.lines.values())

    @property
    def fits_poorly(self) -> bool:
        return any(line.bends for line in self.lines.values())

    def text(self) -> str:
        """The window, the measured means at its first, middle and last evaluation, the line's ends, each seed's
        slope ± its standard error, and what may be said of the slope across seeds."""
        shown = {p.step: p for p in (self.first, self.middle, self.last)}.values()
        measured = ", ".join(f"{statistics.fmean(p.values):.2f} at {p.tokens / 1e6:.2f}M" for p in shown)
        seeds = "; ".join(f"seed {seed} {line.slope:+.3f}" + (f" ± {line.slope_se:.3f}" if line.slope_se is not None
                                                              else "")
                          for seed, line in self.lines.items())
        slopes = [line.slope for line in self.lines.values()]
        head = (f"steps {self.first.step}-{self.last.step} ({self.evaluations} evaluations): measured mean "
                f"{measured}; the line runs from {self.fitted(self.first.tokens):.2f} to "
                f"{self.fitted(self.last.tokens):.2f}; per doubling {seeds} (slope ± standard error); "
                f"mean {statistics.fmean(slopes):+.3f}")
        if self.fits_poorly:
            bent = ", ".join(f"seed {seed} p={line.bend_p:.3f}" for seed, line in self.lines.items() if line.bends)
            return (f"{head}: **the line fits poorly** (a bend in log tokens fits better: {bent}), so read the "
                    "measured values, not the slope")
        if len(slopes) < MIN_SEEDS_FOR_LABEL:
            return f"{head}: no interval across {len(slopes)} seed{'s' if len(slopes) > 1 else ''}"
        low, high = t_interval(slopes)
        return (f"{head} ± {statistics.stdev(slopes):.3f} [{low:+.3f}, {high:+.3f}]: "
                + interval_label(slopes, below="falling", above="rising"))


def window_steps(by_variant: dict[str, list]) -> list[int]:
    """The steps every variant has a complete multiplier at, before any LR decay."""
    usable = [{p.step for p in points if p.complete and not p.decay} for points in by_variant.values()]
    return sorted(set.intersection(*usable)) if usable else []


def trend(points: list, steps: list[int] | None = None) -> Trend | None:
    """The multiplier's Trend over `steps` (default: the points' own complete evaluations before any decay);
    None with fewer than 3."""
    if steps is None:
        steps = window_steps({"": points})
    window = [p for p in points if p.step in set(steps)]
    if len(window) < 3:
        return None
    log_tokens = [math.log2(p.tokens) for p in window]
    return Trend(window, {seed: SeedLine.fit(log_tokens, [p.by_seed[seed] for p in window])
                          for seed in window[0].by_seed})
