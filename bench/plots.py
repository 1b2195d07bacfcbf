"""PNG plots for the benchmark reports (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, NullFormatter

Series = Mapping[str, Sequence[float]]  # label -> one y value per x


def lines(
    path: Path,
    x: Sequence[float],
    panels: Mapping[str, Series],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    log_y: bool = False,
    hlines: Mapping[str, float] | None = None,
) -> Path:
    """One panel per entry of `panels` side by side, one line per series; x on a log2 axis."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, (panel, series) in zip(axes[0], panels.items(), strict=True):
        for label, ys in series.items():
            ax.plot(x, ys, marker="o", label=label)
        for label, y in (hlines or {}).items():
            ax.axhline(y, linestyle="--", linewidth=1, color="grey")
            ax.annotate(label, (x[0], y), textcoords="offset points", xytext=(2, 3), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(x), [str(int(v)) for v in x])
        if log_y:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(panel)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def curves(path: Path, x: Sequence[float], series: Series, *, xlabel: str, title: str) -> Path:
    """One panel, one line per series, over a linear x (a learning curve by round)."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for label, ys in series.items():
        ax.plot(x, ys, marker=".", label=label)
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
