"""Every route fuzzed at a small size (issue 13): `python -m bench.fuzz` (the same at full size)
run as a process against its own proxy on the fake vLLM and real Postgres; its report read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_no_route_fails_with_a_server_error_and_postgres_holds_what_was_acknowledged(
    postgres_url: str, tmp_path: Path
) -> None:
    report = tmp_path / "fuzz.md"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.fuzz",
            "--examples",
            "15",
            "--completion-examples",
            "150",
            "--database-url",
            postgres_url,
            "--results",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = [
        cells
        for line in report.read_text().splitlines()
        if line.startswith("| ")
        and (cells := [c.strip() for c in line.split("|")[1:-1]])[0].isdigit()
    ]
    cases, ok, refused, server_errors, hangs, acknowledged, missing, extra = map(int, row)
    assert cases > 200 and ok > 0 and refused > 0  # both valid and refused input
    assert (server_errors, hangs) == (0, 0), report.read_text()
    # Exactly what was answered with a transition id is stored: refused input leaves nothing.
    assert acknowledged > 0 and (missing, extra) == (0, 0)
