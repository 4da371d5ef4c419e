"""PNG plots of benchmark ratios (matplotlib, no display needed). Used by `make bench`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_ratios(
    series: Mapping[str, Sequence[float]],
    labels: Sequence[str],
    out: Path,
    *,
    title: str,
    ylabel: str = "ours / redis-server (throughput)",
) -> Path:
    """Grouped bars: one group per label (block size), one bar per series; a line at 1.0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (n - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in values], fontsize=7, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("block size")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
