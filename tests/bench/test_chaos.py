"""A short run of the chaos suite (bench/chaos.py; the full run and its table are in
docs/reliability.md): under traffic, nothing the clients were told was stored is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fakes import processes

pytestmark = pytest.mark.slow

# (the 10k burst: test_rewards.py; the trainer killed mid-step: test_trainer_loop.py)
FAULTS = (
    "pg-kill",
    "journal-full",
    "proxy-kill-durable",
    "trainer-kill-publish",
    "pg-partition",  # packets dropped, not refused: iptables, fakes/netfault.py
    "pg-stop+proxy-term",  # two at once: SIGTERM and a start while Postgres is down
)


def test_faults_under_traffic_lose_nothing_acknowledged(tmp_path: Path) -> None:
    report = tmp_path / "chaos.md"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.chaos",
            "--faults",
            ",".join(FAULTS),
            "--outage-s",
            "4",
            "--warm-s",
            "1",
            "--clients",
            "4",
            "--results",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {
        cells[0]: cells
        for line in report.read_text().splitlines()
        if line.startswith("| ")
        and (cells := [c.strip() for c in line.split("|")[1:-1]])
        and cells[0] in FAULTS
    }
    assert set(rows) == set(FAULTS)
    for fault, cells in rows.items():
        # A fault the run could not make is a failure, not a pass (the journal faults mount a
        # tmpfs, which needs root: run the suite as root, as CI does, or in a VM/container that is).
        assert cells[1] != "-", f"{fault} was not run: {cells[2]}"
        acknowledged, stored, lost = (int(c) for c in cells[2:5])
        rewards, rewards_stored, rewards_lost = (int(c) for c in cells[5:8])
        assert acknowledged > 0 and rewards > 0, cells
        assert (lost, rewards_lost) == (0, 0), " | ".join(cells) + _log_tail(fault)
        assert (stored, rewards_stored) == (acknowledged, rewards), " | ".join(cells)
    # The killed trainer's claims were taken over, its half-published adapter cleared away, and
    # the versions still form one chain.
    note = rows["trainer-kill-publish"][9]
    assert not note.startswith("FAILED") and "half-published adapter unloaded" in note, note


def _log_tail(fault: str) -> str:
    """What bench.chaos keeps when something was lost: the end of the fault's proxy log and
    the post-mortem (the server's backends and locks, the journal's metrics and files)."""
    kept = processes.WORK / "chaos" / f"{fault}-proxy.log"
    tail = "\n".join(kept.read_text().splitlines()[-60:]) if kept.exists() else ""
    post = kept.with_name(f"{fault}-post-mortem.txt")
    return "\n" + tail + ("\n" + post.read_text() if post.exists() else "")
