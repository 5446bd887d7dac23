"""Validation loss against tokens and against training compute, and MoE load imbalance against steps;
one line per run."""
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


def moe_imbalance(groups: list[Group], path: Path) -> Path | None:
    """max / mean expert load (mean over MoE layers) at every logged step; None when no run logged it."""
    fig, (ax,) = new_figure(width=7, height=4.5)
    colors = palette([g.variant for g in groups])
    sizes = list(dict.fromkeys(g.size for g in groups))
    drawn = False
    for group in groups:
        for run in group.runs:
            points = run.moe_curve
            if points:
                drawn = True
                ax.plot(*zip(*points), color=colors[group.variant],
                        linestyle=SIZE_STYLES[sizes.index(group.size) % len(SIZE_STYLES)],
                        label=f"{group.size} {group.variant} s{run.seed}")
    if not drawn:
        return None
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set(xlabel="step", ylabel="max / mean expert load", title="MoE load imbalance (1 = balanced)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path)
