"""PNG charts of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from typing import Any

from pagedrs.bench.charts import bars, pyplot, save

_COLORS = {"paged": "#2a7ab9", "contiguous": "#d9822b", "hf": "#7f7f7f"}
_NAMES = {"paged": "pagedrs paged", "contiguous": "pagedrs contiguous", "hf": "transformers static"}


def plot_throughput(data: dict[str, Any], plot_dir: str) -> list[str]:
    plt = pyplot()
    systems = [s for s in ("paged", "contiguous", "hf") if s in data]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    bars(ax, [_NAMES[s] for s in systems], [data[s]["tokens_per_s"] for s in systems], [_COLORS[s] for s in systems], "{:.1f}")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Throughput, same KV budget ({data['kv_budget']['bytes'] / 2**20:.0f} MiB)")
    paths.append(save(plt, fig, plot_dir, "throughput.png"))

    fig, ax = plt.subplots(figsize=(9, 4))
    mib = data["kv_budget"]["bytes_per_token"] / 2**20
    for s in systems:
        tl = data[s]["timeline"]
        ax.plot(tl["t"], [r * mib for r in tl["reserved_slots"]], color=_COLORS[s], label=f"{_NAMES[s]}: reserved")
        ax.plot(tl["t"], [v * mib for v in tl["live_slots"]], color=_COLORS[s], linestyle="--", label=f"{_NAMES[s]}: live tokens")
    ax.axhline(data["kv_budget"]["bytes"] / 2**20, color="black", linewidth=0.8, label="budget")
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV memory (MiB)")
    ax.set_title("KV memory in use over time")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(save(plt, fig, plot_dir, "kv_memory_over_time.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in systems:
        values = data[s]["utilization_per_step"]
        weights = [1.0 / len(values)] * len(values) if values else None  # systems run different step counts
        ax.hist(values, bins=20, range=(0, 1), weights=weights, alpha=0.6, color=_COLORS[s], label=_NAMES[s])
    ax.set_xlabel("KV utilization per step (live slots / reserved slots)")
    ax.set_ylabel("share of steps")
    ax.set_title("KV utilization")
    ax.legend()
    paths.append(save(plt, fig, plot_dir, "kv_utilization_hist.png"))
    return paths


def plot_prefix(data: dict[str, Any], plot_dir: str) -> list[str]:
    plt = pyplot()
    on, off = data["caching_on"], data["caching_off"]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.6))
    colors = ["#2a7ab9", "#d9822b"]
    labels = ["caching on", "caching off"]
    bars(axes[0], labels, [on["pages_per_running_seq"], off["pages_per_running_seq"]], colors, "{:.1f}")
    axes[0].set_title("pages per running sequence")
    bars(axes[1], labels, [on["prefill_tokens_computed"], off["prefill_tokens_computed"]], colors, "{:.0f}")
    axes[1].set_title("prefill tokens computed")
    bars(axes[2], labels, [on["median_ttft_s"], off["median_ttft_s"]], colors, "{:.2f}")
    axes[2].set_title("median TTFT (s)")
    return [save(plt, fig, plot_dir, "prefix_sharing.png")]


def plot_preemption(data: dict[str, Any], plot_dir: str) -> list[str]:
    plt = pyplot()
    palette = {"swap": "#2a7ab9", "swap-whole": "#7fb3d9", "recompute": "#d9822b", "auto": "#4c9a2a"}
    modes = [m for m in palette if m in data]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    colors = [palette[m] for m in modes]
    bars(axes[0], modes, [data[m]["tokens_per_s"] for m in modes], colors, "{:.1f}")
    axes[0].set_title("tokens / s")
    bars(axes[1], modes, [data[m]["pages_moved"] + data[m]["recomputed_tokens"] / data["block_size"] for m in modes], colors, "{:.0f}")
    axes[1].set_title("pages moved + recomputed (in pages)")
    return [save(plt, fig, plot_dir, "preemption.png")]


def plot_allocator(data: dict[str, Any], plot_dir: str) -> list[str]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    bars(ax, ["Rust (PyO3)", "pure Python"], [data["rust_ops_per_s"], data["python_ops_per_s"]], ["#2a7ab9", "#7f7f7f"], "{:,.0f}")
    ax.set_ylabel("block-manager calls / s")
    ax.set_title(f"Allocator: {data['ratio']:.1f}x")
    return [save(plt, fig, plot_dir, "allocator.png")]


def plot_multiturn(data: dict[str, Any], plot_dir: str) -> list[str]:
    from pagedrs.bench.multiturn import plot

    return plot(data, plot_dir)


PLOTTERS = {
    "throughput": plot_throughput,
    "prefix": plot_prefix,
    "preemption": plot_preemption,
    "allocator": plot_allocator,
    "multiturn": plot_multiturn,
}
