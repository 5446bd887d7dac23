"""Figures across groups: loss vs block size (paper Figure 6) and the compute scaling fit (Figure 4)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from scripts.report.figure import new_figure, palette, save
from scripts.report.runs import Group
from scripts.report.stats import PowerLaw, mean_std


def final_losses(group: Group) -> list[float]:
    return [run.final_val_loss for run in group.runs if run.final_val_loss is not None]


def sweep_sizes(groups: list[Group]) -> list[str]:
    """Sizes with at least two plain Block groups of different block sizes."""
    sizes = dict.fromkeys(g.size for g in groups)
    return [s for s in sizes if len({g.block_size for g in groups if g.size == s and g.is_plain_block}) >= 2]


def block_size_sweep(groups: list[Group], size: str, path: Path) -> Path:
    fig, (ax,) = new_figure()
    blocks = sorted((g for g in groups if g.size == size and g.is_plain_block and final_losses(g)),
                    key=lambda g: g.block_size)
    stats = [mean_std(final_losses(g)) for g in blocks]
    ax.errorbar([g.block_size for g in blocks], [m for m, _ in stats], yerr=[s or 0 for _, s in stats],
                marker="o", capsize=3, label="block")
    for kind, style in (("full", "--"), ("baseline", ":")):
        reference = [g for g in groups if g.size == size and g.variant == kind and final_losses(g)]
        if reference:
            ax.axhline(mean_std(final_losses(reference[0]))[0], linestyle=style, color="gray", label=kind)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="block size S (sublayers)", ylabel="final validation loss", title=f"{size}: block-size sweep")
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, path)


def scaling(points: dict[str, list[tuple[float, float]]], fits: dict[str, PowerLaw], path: Path) -> Path:
    """points: variant -> [(compute, mean final loss)] per size; fits: the variants with >= 3 sizes."""
    fig, (ax,) = new_figure(width=7, height=4.5)
    colors = palette(list(points))
    for variant, pts in points.items():
        compute, loss = zip(*sorted(pts))
        ax.scatter(compute, loss, color=colors[variant])
        if variant in fits:
            fit = fits[variant]
            ax.plot(compute, [fit.loss(c) for c in compute], color=colors[variant],
                    label=f"{variant}: L = {fit.A:.3g} C^-{fit.alpha:.4f}")
    ax.set(xscale="log", yscale="log", xlabel="training FLOPs", ylabel="final validation loss",
           title="compute scaling")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save(fig, path)


def lr_families(groups: list[Group]) -> dict[str, list[Group]]:
    """'<model size> <variant>' -> its groups at two or more learning rates (other recipe fields equal), by lr."""
    families: dict[str, list[Group]] = {}
    for group in groups:
        if final_losses(group):
            init = group.runs[0].config.model.init
            families.setdefault(f"{group.model_size} {group.variant} init={init}", []).append(group)
    return {name: sorted(members, key=lambda g: g.lr) for name, members in families.items()
            if len({g.lr for g in members}) >= 2}


def lr_sweep(families: dict[str, list[Group]], path: Path) -> Path:
    """Final validation loss (mean ± std over seeds) against the peak learning rate, one line per family."""
    fig, (ax,) = new_figure(width=7, height=4.5)
    for name, members in families.items():
        stats = [mean_std(final_losses(g)) for g in members]
        ax.errorbar([g.lr for g in members], [m for m, _ in stats], yerr=[s or 0 for _, s in stats],
                    marker="o", capsize=3, label=name)
    ax.set_xscale("log")
    ax.set(xlabel="peak learning rate", ylabel="final validation loss", title="learning-rate sweep")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save(fig, path)


def parabola_minimum(lrs: list[float], losses: list[float]) -> float | None:
    """The learning rate at the minimum of the parabola in log2(lr) through the best point and its two
    neighbours (lrs sorted ascending); None when the best point is at the edge or the points curve down.
    Two nearly equal best points say the optimum lies between them; this says where."""
    best = min(range(len(losses)), key=losses.__getitem__)
    if best in (0, len(losses) - 1):
        return None
    x = [math.log2(lr) for lr in lrs[best - 1:best + 2]]
    a, b, _ = np.polyfit(x, losses[best - 1:best + 2], 2)
    return 2 ** (-b / (2 * a)) if a > 0 else None
