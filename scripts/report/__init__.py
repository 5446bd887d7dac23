"""The comparison report: report.md plus PNG figures built from run directories.

runs.py reads and groups runs, stats.py holds the numbers (paired differences with their t interval, p-value and
noise label, Holm's adjustment, power-law fit), table.py the results table, sanity.py the one-block / x0 checks,
multiplier.py the token multiplier and compute-equivalent speedup, trend.py the multiplier's trend per doubling,
tuning.py the per-arm tuning sweep and the "each tuned" setting, curves.py / depth.py / sweeps.py the figures,
build.py puts report.md together.
"""
from scripts.report.build import build_report

__all__ = ["build_report"]
