"""The comparison report: report.md plus PNG figures built from run directories.

runs.py reads and groups runs, stats.py holds the numbers (paired differences with their t interval and noise
label, power-law fit), table.py the results table, sanity.py the one-block / x0 checks, multiplier.py the token
multiplier, curves.py / depth.py / sweeps.py the figures, build.py puts report.md together.
"""
from scripts.report.build import build_report

__all__ = ["build_report"]
