"""What happens along depth at the end of training, from diagnostics.jsonl (mean over a group's seeds):
output and gradient magnitudes (paper Figure 5 b/c), depth-attention maps (Figure 8) and layer importance.

depth_weights rows are reading sublayers "1".."L+1" (L+1 is the final read); odd sublayers read
before attention, even ones before the MLP. Columns are source indices: v_i for Full, blocks
b_0..b_n (the last one the partial sum) for Block.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
from matplotlib.ticker import MaxNLocator

from scripts.depth_matrix import reader_extent
from scripts.report.figure import new_figure, palette, save
from scripts.report.runs import Group
from trainer.metrics import entropy

SHARE_SCALE = 0.5  # colour range of the M panel: larger shares (the first reads, one source) saturate
MAGNITUDE_VARIANTS = ("baseline", "highway", "x0", "full", "block", "mhc", "hc")


def mean_record(group: Group, key: str) -> dict:
    """A final-diagnostics entry averaged over seeds ({} when no run has it)."""
    records = [run.final_diagnostics[key] for run in group.runs
               if run.final_diagnostics is not None and key in run.final_diagnostics]
    if not records:
        return {}
    if isinstance(next(iter(records[0].values())), dict):  # depth_weights: row -> {source: weight}
        return {row: {col: statistics.fmean(r[row].get(col, 0.0) for r in records) for col in records[0][row]}
                for row in records[0]}
    return {k: statistics.fmean(r[k] for r in records) for k in records[0]}


def _plain(group: Group) -> bool:
    return group.kind in ("baseline", "highway", "x0", "mhc", "hc") or group.variant == "full" or group.is_plain_block


def magnitudes(groups: list[Group], size: str, path: Path) -> Path | None:
    """Per-sublayer output RMS and per-block gradient RMS of the plain variants of one size."""
    chosen = [g for g in groups if g.size == size and _plain(g) and mean_record(g, "output_rms")]
    if not chosen:
        return None
    fig, (out_ax, grad_ax) = new_figure(2, width=5.5)
    colors = palette([g.variant for g in groups])
    for group in chosen:
        out, grad = mean_record(group, "output_rms"), mean_record(group, "grad_rms")
        out_x = sorted(out, key=int)
        out_ax.plot([int(k) for k in out_x], [out[k] for k in out_x], marker="o", color=colors[group.variant],
                    label=group.variant)
        grad_x = sorted(grad, key=int)
        grad_ax.plot([int(k) for k in grad_x], [grad[k] for k in grad_x], marker="o", color=colors[group.variant],
                     label=group.variant)
    out_ax.set(xlabel="sublayer (odd: attention, even: MLP)", ylabel="output RMS", yscale="log",
               title=f"{size}: output magnitude")
    grad_ax.set(xlabel="transformer block", ylabel="gradient RMS", yscale="log", title=f"{size}: gradient magnitude")
    grad_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (out_ax, grad_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save(fig, path)


def depth_matrix(weights: dict, rows: list[str]) -> np.ndarray:
    """Rows = the given reading sublayers, columns = source index; NaN where a source is not visible."""
    width = 1 + max(int(col) for row in weights.values() for col in row)
    matrix = np.full((len(rows), width), np.nan)
    for i, row in enumerate(rows):
        for col, weight in weights[row].items():
            matrix[i, int(col)] = weight
    return matrix


def split_rows(weights: dict) -> tuple[list[str], list[str]]:
    """(pre-attention rows with the final read last, pre-MLP rows)."""
    rows = sorted(weights, key=int)
    return [r for r in rows if int(r) % 2 == 1], [r for r in rows if int(r) % 2 == 0]


def depth_heatmaps(group: Group, path: Path) -> dict[str, float] | None:
    """Two heatmaps (pre-attention, pre-MLP) with each row's entropy; returns the mean entropy of each."""
    weights = mean_record(group, "depth_weights")
    if not weights:
        return None
    final = str(max(int(r) for r in weights))
    fig, axes = new_figure(2, width=5.5, height=4.5)
    mean_entropy = {}
    for ax, rows, title in zip(axes, split_rows(weights), ("pre-attention", "pre-MLP")):
        matrix = depth_matrix(weights, rows)
        image = ax.imshow(matrix, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        entropies = [entropy(list(weights[row].values())) for row in rows]
        ax.set_yticks(range(len(rows)), [("final" if row == final else f"l={row}") + f"  H={abs(h):.2f}"
                                         for row, h in zip(rows, entropies)], fontsize=7)
        ax.set(xlabel="source index (Full: v_i; Block: b_n, last = partial sum)", title=f"{group.variant}: {title}")
        fig.colorbar(image, ax=ax, label="alpha")
        mean_entropy[title] = statistics.fmean(entropies)
    fig.suptitle(f"{group.size} {group.variant}: depth attention at the end of training (H = row entropy, nats)",
                 fontsize=9)
    save(fig, path)
    return mean_entropy


def importance(weights: dict) -> dict[int, float]:
    """I_i = sum over the reading layers l > i of alpha_{i->l} (source i is only visible to later layers)."""
    scores: dict[int, float] = {}
    for row in weights.values():
        for col, weight in row.items():
            scores[int(col)] = scores.get(int(col), 0.0) + weight
    return dict(sorted(scores.items()))


def layer_importance(groups: list[Group], path: Path) -> Path | None:
    with_weights = [(g, mean_record(g, "depth_weights")) for g in groups]
    with_weights = [(g, w) for g, w in with_weights if w]
    if not with_weights:
        return None
    fig, axes = new_figure(len(with_weights), width=4.5, height=3.5, columns=3)
    for ax, (group, weights) in zip(axes, with_weights):
        scores = importance(weights)
        ax.bar(list(scores), list(scores.values()))
        ax.set(xlabel="source index", ylabel="I_i = sum_l alpha_{i->l}", title=f"{group.size} {group.variant}")
        ax.grid(alpha=0.3, axis="y")
    return save(fig, path)


def mean_matrix(group: Group) -> tuple[np.ndarray, list[dict]] | None:
    """The mean M over the group's seeds (NaN above the diagonal) and each run's summary, or None."""
    summaries = [run.depth_matrix for run in group.runs if run.depth_matrix is not None]
    if not summaries:
        return None
    means = [np.array([[np.nan if v is None else v for v in row] for row in s["mean"]]) for s in summaries]
    return np.mean(means, axis=0), summaries


def matrix_panels(groups: list[Group], path: Path) -> tuple[Path, list[str]] | None:
    """Every group's mean M side by side as each read's shares (a row divided by the sum of its |weights|,
    so the baseline's rows are uniform 1/l like an even softmax), and a table row per group."""
    found = [(g, m) for g in groups if (m := mean_matrix(g)) is not None]
    if not found:
        return None
    fig, axes = new_figure(len(found), width=3.6, height=3.3, columns=4)
    rows = []
    for ax, (group, (matrix, summaries)) in zip(axes, found):
        shares = matrix / np.nansum(np.abs(matrix), axis=1, keepdims=True)
        image = ax.imshow(shares, cmap="RdBu_r", vmin=-SHARE_SCALE, vmax=SHARE_SCALE, interpolation="nearest",
                          extent=reader_extent(len(matrix)))
        ax.set(title=f"{group.size} {group.variant}", xlabel="source i (0: embedding)", ylabel="reader l")
        rank = [s["semiseparable_rank"] for s in summaries]
        entropy_rows = np.mean([s["row_entropy"] for s in summaries], axis=0)
        rows.append(f"| {group.size} | {group.variant} | {len(summaries)} "
                    f"| {statistics.fmean(r['mean'] for r in rank):.2f} | {max(r['max'] for r in rank)} "
                    f"| {statistics.fmean(entropy_rows[1:]):.3f} |")
    fig.colorbar(image, ax=axes, shrink=0.6, label=f"share of the read (M row / sum |M row|), clipped at +-{SHARE_SCALE}")
    fig.savefig(path, dpi=110)
    return path, rows
