"""The matplotlib pieces every benchmark chart uses (Agg backend: no display needed)."""

from __future__ import annotations

import os
from typing import Any


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt: Any, fig: Any, plot_dir: str, name: str) -> str:
    os.makedirs(plot_dir, exist_ok=True)
    path = os.path.join(plot_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bars(ax: Any, labels: list[str], values: list[float], colors: list[str], fmt: str) -> None:
    bars = ax.bar(labels, values, color=colors)
    for bar, v in zip(bars, values):
        ax.annotate(fmt.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
