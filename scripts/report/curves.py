"""Validation loss against tokens and against training compute, lm_eval task metrics against tokens
(train.eval_tasks), and MoE load imbalance against steps; one line per run."""
from __future__ import annotations

from pathlib import Path

from scripts.report.figure import new_figure, palette, save
from scripts.report.runs import Group

SIZE_STYLES = ("-", "--", ":", "-.")


def _plot(groups: list[Group], path: Path, x_of, xlabel: str) -> Path:
    fig, (ax,) = new_figure(width=7, height=4.5)
    colors = palette([g.variant for g in groups])
    sizes = list(dict.fromkeys(g.size for g in groups))
    for group in groups:
        for run in group.runs:
            curve = run.val_curve
            if not curve:
                continue
            ax.plot([x_of(run, tokens) for tokens, _ in curve], [loss for _, loss in curve], marker=".",
                    color=colors[group.variant], linestyle=SIZE_STYLES[sizes.index(group.size) % len(SIZE_STYLES)],
                    label=f"{group.size} {group.variant} s{run.seed}")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path)


def loss_vs_tokens(groups: list[Group], path: Path) -> Path:
    return _plot(groups, path, lambda run, tokens: tokens, "training tokens")


def loss_vs_compute(groups: list[Group], path: Path) -> Path:
    return _plot(groups, path, lambda run, tokens: tokens * run.flops_per_token, "training FLOPs (model/flops.py)")


def _run_lines(ax, groups: list[Group], points_of, **style) -> bool:
    """One line per run with points (points_of(run): [(x, y), ...], empty or None for none), coloured by variant
    and dashed by size; whether any was drawn."""
    colors = palette([g.variant for g in groups])
    sizes = list(dict.fromkeys(g.size for g in groups))
    drawn = False
    for group in groups:
        for run in group.runs:
            points = points_of(run)
            if points:
                drawn = True
                ax.plot(*zip(*points), color=colors[group.variant],
                        linestyle=SIZE_STYLES[sizes.index(group.size) % len(SIZE_STYLES)],
                        label=f"{group.size} {group.variant} s{run.seed}", **style)
    return drawn


def task_metrics_vs_tokens(groups: list[Group], path: Path) -> Path | None:
    """One panel per task metric that train.eval_tasks logged, against tokens; None when no run logged any."""
    metrics = sorted({name for group in groups for run in group.runs for name in run.task_curves})
    if not metrics:
        return None
    fig, axes = new_figure(len(metrics), width=4.5, height=3.5, columns=min(3, len(metrics)))
    for ax, metric in zip(axes, metrics):
        _run_lines(ax, groups, lambda run: run.task_curves.get(metric), marker=".")
        ax.set_xscale("log")
        ax.set(xlabel="training tokens", title=metric)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return save(fig, path)


def moe_imbalance(groups: list[Group], path: Path) -> Path | None:
    """max / mean expert load (mean over MoE layers) at every logged step; None when no run logged it."""
    fig, (ax,) = new_figure(width=7, height=4.5)
    if not _run_lines(ax, groups, lambda run: run.moe_curve):
        return None
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set(xlabel="step", ylabel="max / mean expert load", title="MoE load imbalance (1 = balanced)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path)
