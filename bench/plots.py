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


def estimates(
    path: Path,
    rows: Sequence[tuple[int, float | None, tuple[float, float] | None, float | None]],
    corrupted: Sequence[float | None],
    *,
    title: str,
) -> Path:
    """Estimates against what was measured. `rows`: (version, estimate, its interval, measured
    reward); `corrupted`: the measured reward of each candidate made bad on purpose. Left, by
    version: each estimate with its interval and the measured reward (a version refused an
    estimate has the measurement alone); right, estimate against measured, the diagonal exact."""
    fig, (by_version, calibration) = plt.subplots(1, 2, figsize=(12, 4.2))
    est = [(v, e, i) for v, e, i, _ in rows if e is not None and i is not None]
    if est:
        low = [e - i[0] for _, e, i in est]
        high = [i[1] - e for _, e, i in est]
        by_version.errorbar(
            [v for v, _, _ in est], [e for _, e, _ in est], yerr=[low, high], fmt="o",
            markersize=4, capsize=2, label="estimate (interval)",
        )  # fmt: skip
    measured = [(v, m) for v, _, _, m in rows if m is not None]
    by_version.plot([v for v, _ in measured], [m for _, m in measured], "x", label="measured")
    for i, m in enumerate(corrupted):
        if m is not None:
            x = (max(v for v, *_ in rows) if rows else 0) + 1 + i
            by_version.plot([x], [m], "rv", label="corrupted candidates" if i == 0 else None)
    by_version.set_xlabel("version")
    by_version.set_ylabel("episode reward")
    by_version.grid(True, alpha=0.3)
    by_version.legend(fontsize=8)
    pairs = [(e, m) for _, e, i, m in rows if e is not None and m is not None]
    if pairs:
        calibration.plot([m for _, m in pairs], [e for e, _ in pairs], "o", markersize=4)
        ends = [min(min(p) for p in pairs), max(max(p) for p in pairs)]
        calibration.plot(ends, ends, "--", color="grey", linewidth=1)
    calibration.set_xlabel("measured reward (served to a stream the gate never saw)")
    calibration.set_ylabel("estimate from logged traffic")
    calibration.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
