"""Smoke run of bench/learning_curve.py's TRL side (two GRPO steps), so the script never rots.

Flywheel's side is the loop tests/e2e/test_e2e_loop.py already runs; no timing is asserted here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from demo.tiny_model import build_demo_model
from tests.conftest import TEST_HOME

pytestmark = pytest.mark.slow


def test_learning_curve_smoke(tmp_path: Path) -> None:
    model = build_demo_model(TEST_HOME / "models" / "demo")  # random weights: rewards near 0
    report, plots = tmp_path / "learning.md", tmp_path / "img"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.learning_curve",
            "--smoke",
            "--skip-flywheel",
            "--threads",
            "1",
            "--model",
            str(model),
            "--results",
            str(report),
            "--plots",
            str(plots),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]

    text = report.read_text()
    assert text.startswith("# Learning curve") and "TRL GRPOTrainer" in text
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| 32 |")]
    assert len(rows) == 1  # two steps of 16 samples: one table row at 32 samples
    reward, wall_s = float(rows[0][2]), float(rows[0][3])
    assert 0.0 <= reward <= 1.0 and wall_s >= 0
    for name in ["learning_curve_samples.png", "learning_curve_wall.png"]:
        assert (plots / name).read_bytes().startswith(b"\x89PNG"), name
        assert f"]({plots.name}/{name})" in text
