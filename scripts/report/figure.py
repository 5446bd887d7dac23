"""Matplotlib set-up shared by the report's figures: the Agg backend (no display) and one colour per variant."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)


def new_figure(panels: int = 1, width: float = 6.0, height: float = 4.0, columns: int | None = None):
    """A figure of `panels` axes of width x height inches each, `columns` per row (default: one row)."""
    columns = min(columns or panels, panels)
    rows = -(-panels // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    axes = list(axes.flat)
    for unused in axes[panels:]:
        unused.set_visible(False)
    return fig, axes[:panels]


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def palette(labels: list[str]) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {label: cycle[i % len(cycle)] for i, label in enumerate(dict.fromkeys(labels))}
