"""Numbers the report states: seed statistics, paired differences with their Student-t interval, p-value and
noise label, Holm's adjustment of a family of them, power-law fits, compute multipliers."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

CONFIDENCE = 0.95


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None with fewer than two values)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def t_interval(values) -> tuple[float, float] | None:
    """The 95% Student-t interval of the mean (n - 1 degrees of freedom); None with fewer than two values."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = scipy_stats.t.ppf(0.5 + CONFIDENCE / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half


@dataclass(frozen=True)
class Paired:
    """Per-seed differences a - b (same seed: same data order, same initial weights for shared parameters),
    with the paired t and its 95% Student-t interval (n - 1 degrees of freedom; none with one seed).
    Negative is a lower loss: a ahead of b."""
    diffs: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.diffs)

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.diffs) if self.n > 1 else None

    @property
    def t(self) -> float | None:
        """mean / (sd / sqrt(n)); infinite when every seed gives the same non-zero difference."""
        if self.sd is None:
            return None
        if self.sd == 0:
            return math.copysign(math.inf, self.mean) if self.mean else 0.0
        return self.mean / (self.sd / math.sqrt(self.n))

    @property
    def interval(self) -> tuple[float, float] | None:
        return t_interval(self.diffs)

    @property
    def p(self) -> float | None:
        """The two-sided p-value of the paired t (n - 1 degrees of freedom): below 0.05 exactly where the 95%
        interval excludes 0. None with one seed."""
        if self.t is None:
            return None
        return float(2 * scipy_stats.t.sf(abs(self.t), self.n - 1))

    @property
    def excludes_zero(self) -> bool:
        return interval_excludes_zero(self.diffs)

    def label(self) -> str:
        """The noise label, in words, from the interval: which side is ahead (lower loss), and on how many seeds."""
        return interval_label(self.diffs, below="ahead", above="behind")

    def text(self) -> str:
        """'-0.0360 ± 0.0014 (n=3, t=-45.0, 95% CI [-0.0395, -0.0325])'; one seed: '+0.0120 (n=1)'."""
        if self.n == 1:
            return f"{self.mean:+.4f} (n=1)"
        low, high = self.interval
        return f"{self.mean:+.4f} ± {self.sd:.4f} (n={self.n}, t={self.t:+.1f}, 95% CI [{low:+.4f}, {high:+.4f}])"


def interval_excludes_zero(values) -> bool:
    """Whether the 95% interval of the mean lies wholly on one side of 0 (never with one value)."""
    interval = t_interval(values)
    return interval is not None and not interval[0] <= 0 <= interval[1]


def interval_label(values, below: str, above: str) -> str:
    """Per-seed values' 95% interval in words: `below` or `above` 0 (and on how many seeds) where the interval
    excludes 0, else that it cannot be told from 0 at this n."""
    n = len(values)
    if n == 1:
        return "n=1: no interval"
    if not interval_excludes_zero(values):
        return f"not separable from 0 with n={n}"
    mean = statistics.fmean(values)
    agreeing = sum(1 for v in values if (v < 0) == (mean < 0) and v != 0)
    seeds = "on every seed" if agreeing == n else f"on average ({agreeing} of {n} seeds)"
    return f"{below if mean < 0 else above} {seeds}, interval excludes 0"


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values, in their order: the k-th smallest is multiplied by
    (m - k + 1), capped at 1, and never below the adjusted value of a smaller one. An adjusted value below 0.05
    keeps the family's chance of any false 'excludes 0' at 5%."""
    m = len(p_values)
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(sorted(range(m), key=p_values.__getitem__)):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def paired(a: dict[int, float], b: dict[int, float]) -> Paired | None:
    """a minus b over the seeds both have (seed -> value); None when they share no seed."""
    seeds = sorted(a.keys() & b.keys())
    return Paired(tuple(a[seed] - b[seed] for seed in seeds)) if seeds else None


@dataclass
class PowerLaw:
    """L = A * C^-alpha."""
    A: float
    alpha: float

    def loss(self, compute: float) -> float:
        return self.A * compute ** -self.alpha

    def compute_for(self, loss: float) -> float:
        """The compute at which this law reaches `loss`."""
        return (self.A / loss) ** (1 / self.alpha)


def fit_power_law(compute: list[float], loss: list[float]) -> PowerLaw:
    """Least squares in log-log space: log L = log A - alpha log C."""
    slope, intercept = np.polyfit(np.log(compute), np.log(loss), 1)
    return PowerLaw(A=float(math.exp(intercept)), alpha=float(-slope))


def compute_multiplier(baseline: PowerLaw, loss: float, compute: float) -> float:
    """How much more compute the baseline's law needs to reach `loss` than the `compute` spent on it."""
    return baseline.compute_for(loss) / compute
