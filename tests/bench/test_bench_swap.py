"""Smoke run of bench/hot_swap.py at a tiny size (no timing asserted: that is the report's job)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_hot_swap_smoke(postgres_url: str, tmp_path: Path) -> None:
    report, plot = tmp_path / "swap.md", tmp_path / "swap.png"
    command = [sys.executable, "-m", "bench.hot_swap", "--swaps", "3", "--interval", "0.2"]
    command += ["--clients", "2", "--database-url", postgres_url]
    command += ["--results", str(report), "--plot", str(plot)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    header, *rows = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    assert header.startswith("| when | swaps |") and len(rows) == 1
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[1] == "3 x 0.2 s" and cells[7] == "0"  # every call answered
    served_p50 = float(cells[4].split("/")[0])
    assert served_p50 > 0  # the new version was served after it was published, not before
