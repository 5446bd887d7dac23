"""Numbers the report states: seed statistics, the noise verdict, power-law fits, compute multipliers."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

NOISE_SIGMAS = 2.0  # a difference under 2 pooled standard deviations is called seed noise


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None with fewer than two values)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def pooled_std(a: list[float], b: list[float]) -> float | None:
    if len(a) < 2 or len(b) < 2:
        return None
    return pooled_std_of([a, b])


def pooled_std_of(samples: list[list[float]]) -> float | None:
    """The std pooled over every sample with two or more values (None when there is none)."""
    seeded = [values for values in samples if len(values) > 1]
    if not seeded:
        return None
    dof = sum(len(values) - 1 for values in seeded)
    return math.sqrt(sum((len(values) - 1) * statistics.variance(values) for values in seeded) / dof)


def noise_verdict(values: list[float], baseline: list[float]) -> str:
    """Whether the mean difference to the baseline is distinguishable from seed-to-seed spread."""
    pooled = pooled_std(values, baseline)
    if pooled is None:
        return "single seed, no noise estimate"
    diff = statistics.fmean(values) - statistics.fmean(baseline)
    inside = abs(diff) < NOISE_SIGMAS * pooled
    return f"{'inside' if inside else 'outside'} seed noise (2 x pooled std = {NOISE_SIGMAS * pooled:.4f})"


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
