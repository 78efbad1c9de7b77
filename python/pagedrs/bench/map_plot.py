"""Heatmaps of `pagedrs bench map`: paged / contiguous tokens/s, one panel per shared-prefix share.

The ratio drawn is per CPU-second of the engine process (``ratio_cpu``; torch runs one thread), not
per wall second: on a shared machine the wall clock mostly measures the neighbours, the CPU time the
engine's own work (the wall-clock ratio is in the JSON and the table beside it).

Columns are concurrency, rows the spread of lengths; each cell is annotated with its ratio.
The colours diverge at 1 (blue: paged faster, orange: contiguous faster, on a log scale so 2x
and 0.5x look alike), and the seeds' "skip it" cells, concurrency 1 and spread 1, are outlined
in black and their label underlined with "skip?".
"""

from __future__ import annotations

import math
import re
from typing import Any

from pagedrs.bench.charts import pyplot, save


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]


def plot_model(m: dict[str, Any], plot_dir: str, filename: str) -> str:
    plt = pyplot()
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    cells = m["cells"]
    shares = sorted({c["share"] for c in cells})
    concurrency = sorted({c["concurrency"] for c in cells})
    spreads = sorted({c["spread"] for c in cells})
    by_key = {(c["share"], c["spread"], c["concurrency"]): c["ratio_cpu"] for c in cells}
    ratios = list(by_key.values())
    bound = max(2.0, *(max(r, 1 / r) for r in ratios))  # symmetric in log: 1 sits in the middle
    norm = LogNorm(vmin=1 / bound, vmax=bound)
    width = 0.6 + 0.55 * len(concurrency)
    # The last, narrow column holds the colour bar (tight_layout places it; a shared colorbar would overlap).
    fig, axes = plt.subplots(1, len(shares) + 1, figsize=(max(5.0, width * len(shares) + 1.0), 0.5 * len(spreads) + 1.9),
                             squeeze=False, gridspec_kw={"width_ratios": [width] * len(shares) + [0.15]})
    image = None
    for ax, share in zip(axes[0], shares):
        grid = [[by_key.get((share, s, c), math.nan) for c in concurrency] for s in spreads]
        image = ax.imshow(grid, cmap="PuOr", norm=norm, origin="lower", aspect="auto")
        for i, s in enumerate(spreads):
            for j, c in enumerate(concurrency):
                value = grid[i][j]
                if math.isnan(value):
                    continue
                skip = c == 1 or s == 1
                dark = abs(math.log(value)) > 0.6 * math.log(bound)
                ax.text(j, i, f"{value:.2f}" + ("\nskip?" if skip else ""), ha="center", va="center",
                        fontsize=7, color="white" if dark else "black")
                if skip:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.2))
        ax.set_xticks(range(len(concurrency)), [str(c) for c in concurrency], fontsize=8)
        ax.set_yticks(range(len(spreads)), [f"{s:g}x" for s in spreads], fontsize=8)
        ax.set_xlabel("concurrency", fontsize=8)
        ax.set_title(f"shared prefix {share:.0%}", fontsize=9)
    axes[0][0].set_ylabel("length spread (max/min)", fontsize=8)
    fig.suptitle(f"paged / contiguous tokens per CPU-second, equal KV memory\n{m['model']}", fontsize=9)
    if image is not None:
        ticks = [t for t in (0.25, 0.5, 1.0, 2.0, 4.0, 8.0) if 1 / bound <= t <= bound]
        bar = fig.colorbar(image, cax=axes[0][-1], ticks=ticks)
        bar.ax.set_yticklabels([f"{t:g}x" for t in ticks])
        bar.ax.minorticks_off()
        bar.ax.tick_params(labelsize=7)
    return save(plt, fig, plot_dir, filename)


def plot_map(data: dict[str, Any], plot_dir: str) -> list[str]:
    """One PNG per model: ``map-<model>.png``."""
    return [plot_model(m, plot_dir, f"map-{_slug(m['model'])}.png") for m in data["maps"]]
