"""PNG figures of the reports: per-step simulation, the tuning trade-off, the length histogram.

matplotlib is imported lazily, and only its object API is used (a `Figure` saved through the
Agg canvas), so no global pyplot state or interactive backend is touched. Without matplotlib
the functions raise `PlotsUnavailable`, whose message says what to install.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

FIXED_COLOR, ALIGNED_COLOR, PADDING_COLOR = "#7f7f7f", "#1f77b4", "#d62728"


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _figure(rows: int, cols: int, size: tuple[float, float], **kwargs: Any) -> tuple[Any, Any]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotsUnavailable("the PNG report needs matplotlib: pip install "
                               "'megatron_packing[plots]' (or matplotlib)") from None
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False, **kwargs)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def plot_simulation(runs: Sequence[Mapping[str, Any]], path: str | Path, title: str) -> Path:
    """Per-step bins (padding bins marked), token fill, batch size and rank imbalance.

    ``runs`` are `StepSeries.to_json()` documents (fixed B, then aligned): one column each,
    rows share their y axis so the columns compare directly.
    """
    fig, axes = _figure(4, len(runs), (6.0 * len(runs), 10.0), sharex="col", sharey="row")
    for col, run in enumerate(runs):
        steps = run["per_step"]
        x = np.arange(1, len(steps["bins"]) + 1)
        bins = np.asarray(steps["bins"])
        padding = np.asarray(steps["padding_bins"])
        summary = run["summary"]
        color = ALIGNED_COLOR if col else FIXED_COLOR
        ax = axes[0][col]
        ax.step(x, bins, where="mid", color=color, lw=1, label="bins")
        marked = padding > 0
        ax.bar(x[marked], padding[marked], color=PADDING_COLOR, width=1.0,
               label=f"padding bins ({summary['padding_bins']:,})")
        ax.set_title(f"{run['label']}: {summary['bins']:,} bins, "
                     f"{summary['aligned_fraction']:.1%} of steps aligned", fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
        ax = axes[1][col]
        ax.plot(x, steps["token_fill"], color=color, lw=1)
        ax.axhline(summary["token_fill"], color="black", lw=0.8, ls="--",
                   label=f"overall {summary['token_fill']:.2%}")
        ax.legend(loc="lower right", fontsize=8)
        ax = axes[2][col]
        ax.plot(x, steps["batch_size"], color=color, lw=1,
                label=f"{summary['batch_size_min']}-{summary['batch_size_max']}, "
                      f"token CV {summary['token_cv']:.2%}")
        ax.legend(loc="upper right", fontsize=8)
        ax = axes[3][col]
        ax.plot(x, steps["dp_imbalance"], color=color, lw=1,
                label=f"mean {summary['dp_imbalance_mean']:.4f}")
        ax.legend(loc="upper right", fontsize=8)
        ax.set_xlabel("step")
    for row, name in enumerate(("bins per step", "token fill", "batch size (examples)",
                                "rank imbalance (max / mean)")):
        axes[row][0].set_ylabel(name)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def plot_tuning(points: Sequence[Mapping[str, Any]], fixed: Mapping[int, Mapping[str, Any]],
                chosen: Mapping[str, Any] | None, path: str | Path, title: str) -> Path:
    """Fill, aligned steps, token CV and micro-batches per rank against the variation, one line
    per capacity; fixed B (no variation) as a dashed line; the recommended point starred."""
    fig, axes = _figure(2, 2, (11.0, 8.0))
    panels = (("token_fill", "token fill (padding bins included)", True),
              ("aligned_fraction", "steps aligned to dp", True),
              ("token_cv", "per-step token CV", True),
              ("micro_batches_per_rank", "micro-batches per rank (mean)", False))
    capacities = sorted({p["bin_capacity"] for p in points})
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"]
    for k, (key, label, percent) in enumerate(panels):
        ax = axes[k // 2][k % 2]
        for c, capacity in enumerate(capacities):
            color = palette[c % len(palette)]
            run = sorted((p for p in points if p["bin_capacity"] == capacity and p["problem"] is None),
                         key=lambda p: p["variation"])
            if run:
                ax.plot([p["variation"] for p in run], [p[key] for p in run], marker="o",
                        color=color, label=f"C = {capacity:,}")
            if capacity in fixed and key in fixed[capacity]:
                ax.axhline(fixed[capacity][key], color=color, ls="--", lw=0.8)
        if chosen is not None:
            ax.plot([chosen["variation"]], [chosen[key]], marker="*", ms=16, color="gold",
                    markeredgecolor="black", ls="none", label="recommended")
        if percent:
            ax.yaxis.set_major_formatter(_percent_formatter())
        ax.set_xlabel("packing_batch_size_allowed_variation")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, title="dashed: fixed B", title_fontsize=8)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def plot_length_histogram(lengths: np.ndarray, capacity: int, path: str | Path,
                          title: str) -> Path:
    """Histogram of example lengths (log-spaced bins) with the bin capacity marked."""
    lengths = np.asarray(lengths)
    fig, axes = _figure(1, 1, (8.0, 4.5))
    ax = axes[0][0]
    high = max(int(lengths.max()), capacity) + 1
    edges = np.unique(np.geomspace(max(1, int(lengths.min())), high, 60).astype(int))
    ax.hist(lengths, bins=edges, color=ALIGNED_COLOR)
    over = int((lengths > capacity).sum())
    ax.axvline(capacity, color=PADDING_COLOR, lw=1.5,
               label=f"bin_capacity {capacity:,} ({over:,} longer)")
    for q, style in ((50, ":"), (99, "--")):
        value = float(np.percentile(lengths, q))
        ax.axvline(value, color="black", lw=0.8, ls=style, label=f"p{q} {value:,.0f}")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per example")
    ax.set_ylabel("examples")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def _percent_formatter() -> Any:
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(1.0)
