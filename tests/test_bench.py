"""Smoke runs of the benchmark scripts at tiny sizes, so they never rot (no timing asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_recording_rate_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "results.md"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.recording_rate",
            "--transitions",
            "200",
            "--turns",
            "4",
            "--database-url",
            postgres_url,
            "--results",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "recorded 200/200 transitions" in run.stdout
    header, *rows = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    assert header.startswith("| when |") and len(rows) == 1 and "| 200 | 4 |" in rows[0]


def test_proxy_overhead_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "overhead.md"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.proxy_overhead",
            "--concurrency",
            "1,4",
            "--seconds",
            "0.3",
            "--database-url",
            postgres_url,
            "--results",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = [line for line in report.read_text().splitlines() if line.startswith("| 20")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "4"]
    assert all(row.split("|")[-2].strip() == "0" for row in rows)  # no failed request
    recorded = int(run.stdout.rsplit(":", 1)[1])
    assert recorded > 0
