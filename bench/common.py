"""What the proxy benchmarks share: the load generator, the meters, LiteLLM's proxy (the
baseline), a fresh database, the reports.

Every server runs in its own process (the fake vLLM, `flywheel proxy` and `flywheel trainer` are
started by fakes/processes.py, which the tests share; LiteLLM's proxy here); the load generator
runs in the benchmark's own process on uvloop. `ProcessMeter` reads a server's CPU time and peak
RSS (children included); bench/profile.py attaches py-spy to a running server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import psutil
import psycopg

from core import database, embedded, rollout
from core.vllm import VLLMAdmin
from demo.vllm_server import free_port
from fakes.processes import WORK, Server, child_env, start_server

LITELLM_PIN = "litellm[proxy]==1.106.2"
LITELLM_VENV = WORK / "litellm-venv"
REQUEST_TIMEOUT_S = 60.0  # a request slower than this counts as failed (LiteLLM at 256 clients)
MODEL = "demo"
# a stream's last event but for chat's `[DONE]`: the Responses API's, Anthropic Messages'
STREAM_ENDS = (b'"type":"response.completed"', b'"type":"message_stop"')
# LiteLLM's proxy refuses to start without a master key; every target gets the same header
# (the fake and Flywheel, with no API keys configured, ignore it).
MASTER_KEY = "sk-" + secrets.token_hex(32)

BodyFactory = Callable[[int, int], bytes]  # (client, request number) -> JSON body


# --- the load generator ----------------------------------------------------------------------


@dataclass
class Run:
    """One target under one load: per-request latencies (s), streaming time to first token."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    failed: int = 0
    elapsed: float = 0.0


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0 < q < 1) by linear interpolation; nan when there is nothing to rank."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1]


def add_settings_argument(parser: argparse.ArgumentParser, over: str) -> None:
    """`--set FLYWHEEL_X=V`, repeatable: trainer settings over the benchmark's own (`over`
    says which), as (name, value) pairs in `args.set`."""
    parser.add_argument(
        "--set",
        type=_trainer_setting,
        action="append",
        default=[],
        metavar="FLYWHEEL_X=V",
        help=f"a trainer setting over {over}; recorded",
    )


def _trainer_setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("FLYWHEEL_"):
        raise argparse.ArgumentTypeError(f"expected FLYWHEEL_NAME=VALUE, got {text!r}")
    return name, value


def metric(url: str, name: str, labels: str = "", headers: dict[str, str] | None = None) -> float:
    """The sum of a proxy's metric's samples (those whose labels contain `labels`), read from its
    /metrics (`headers`: the metrics key, where keys are on); 0 if unreachable."""
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if (line.startswith(name + "{") or line.startswith(name + " ")) and labels in line
    )


def first_content(data: bytes) -> bool:
    """Whether an SSE data payload carries generated text (chat delta, completions text, a
    Responses output_text.delta event, or a Messages content_block_delta)."""
    if data == b"[DONE]":
        return False
    event = orjson.loads(data)
    if event.get("type") == "response.output_text.delta":
        return bool(event.get("delta"))
    if event.get("type") == "content_block_delta":
        delta = event.get("delta") or {}
        return bool(delta.get("text") or delta.get("partial_json"))
    for choice in event.get("choices") or ():
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            return True
    return False


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], stream: bool
) -> tuple[float, float | None] | None:
    """Latency and (streaming) time to first token of one call; None when it failed."""
    started = time.perf_counter()
    ttft = None
    async with session.post(url, data=body, headers=headers) as response:
        if not stream:
            await response.read()
            return (time.perf_counter() - started, None) if response.status == 200 else None
        if response.status != 200:
            await response.read()
            return None
        buffer, last = bytearray(), b""
        async for block in response.content.iter_any():
            buffer += block
            while (end := buffer.find(b"\n\n")) != -1:
                event = bytes(buffer[:end])
                del buffer[: end + 2]
                if (data := event.find(b"data:")) == -1:  # after an `event:` line (Responses)
                    continue
                last = event[data + 5 :].strip()
                if ttft is None and first_content(last):
                    ttft = time.perf_counter() - started
        finished = last == b"[DONE]" or any(end in last for end in STREAM_ENDS)
        if not finished or ttft is None:
            return None
        return time.perf_counter() - started, ttft


async def _load(
    url: str, make_body: BodyFactory, concurrency: int, seconds: float, stream: bool
) -> Run:
    run = Run()
    deadline = time.perf_counter() + seconds
    tag = uuid.uuid4().hex[:8]

    async def client(session: aiohttp.ClientSession, n: int) -> None:
        headers = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {MASTER_KEY}",
            "X-Episode-Id": f"bench-{tag}-{n}",
        }
        i = 0
        while time.perf_counter() < deadline:
            try:
                result = await _one(session, url, make_body(n, i), headers, stream)
            except (aiohttp.ClientError, TimeoutError):
                result = None
            i += 1
            if result is None:
                run.failed += 1
                continue
            run.latencies.append(result[0])
            if result[1] is not None:
                run.ttfts.append(result[1])

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session, n) for n in range(concurrency)))
    run.elapsed = time.perf_counter() - started  # until the last call in flight came back
    return run


def load(
    url: str, make_body: BodyFactory, concurrency: int, seconds: float, *, stream: bool = False
) -> Run:
    """`concurrency` clients, each calling back to back for `seconds`, on uvloop when present."""
    coroutine = _load(url, make_body, concurrency, seconds, stream)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def chat_body(
    messages: list[dict[str, str]], *, stream: bool, max_tokens: int = 16, model: str = MODEL
) -> bytes:
    return orjson.dumps(
        {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    )


def responses_body(text: str, *, stream: bool, max_tokens: int = 16) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "input": text, "max_output_tokens": max_tokens, "stream": stream}
    )


# --- meters -----------------------------------------------------------------------------------


class ProcessMeter:
    """CPU seconds and peak RSS of a server process and its children (sampled every 50 ms)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _tree(self) -> list[psutil.Process]:
        return process_tree(self.process.pid)

    def cpu_s(self) -> float:
        return cpu_seconds(self._tree())

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            rss = 0
            for p in self._tree():
                with suppress(psutil.NoSuchProcess):
                    rss += p.memory_info().rss
            self.peak_rss = max(self.peak_rss, rss)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def process_tree(pid: int | None) -> list[psutil.Process]:
    """A process and all its descendants ([] when it is gone or `pid` is None)."""
    if pid is None:
        return []
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU seconds of these processes (ones that have exited count 0)."""
    total = 0.0
    for p in processes:
        try:
            times = p.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def add_fake_arguments(parser: argparse.ArgumentParser) -> None:
    """--latency-s and --lean-fake, for the scripts that start the fake vLLM (see start_fake)."""
    parser.add_argument("--latency-s", type=float, default=0.002, help="the fake's own latency")
    parser.add_argument(
        "--lean-fake",
        action="store_true",
        help="the fake sends token ids/logprobs only when asked (as vLLM): direct calls then cost "
        "it less than the proxy's, which always asks",
    )


def postgres_pid(url: str) -> int | None:
    """The postmaster's pid of an embedded server (socket directory = data directory), if local."""
    host = dict(p.split("=", 1) for p in url.partition("?")[2].split("&") if "=" in p).get("host")
    pid_file = Path(host or "/nonexistent") / "postmaster.pid"
    return int(pid_file.read_text().split()[0]) if pid_file.exists() else None


# --- LiteLLM's proxy, the baseline; a fresh database -------------------------------------------


def litellm_venv(venv: Path = LITELLM_VENV) -> Path:
    """LiteLLM's proxy in a venv of its own (its pins must not touch ours); made on first use."""
    exe = venv / "bin" / "litellm"
    if exe.exists():
        return exe
    print(f"creating {venv} with {LITELLM_PIN} (once; a few minutes)", file=sys.stderr)
    python = shutil.which("python3.11") or sys.executable
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", LITELLM_PIN]
    subprocess.run(pip, check=True)
    return exe


def start_litellm(upstream: str) -> Server:
    """LiteLLM's proxy server: one worker, no database, one model routed to the fake."""
    exe = litellm_venv()
    config = WORK / f"litellm_config-{os.getpid()}.yaml"  # two benchmarks may run at once
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: hosted_vllm/{MODEL}\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: unused\n"
        "litellm_settings:\n"
        "  drop_params: true\n"
    )
    env = child_env(
        LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR", LITELLM_MASTER_KEY=MASTER_KEY
    )
    env.pop("PYTHONPATH")  # its own venv, its own packages
    argv = [str(exe), "--config", str(config), "--host", "127.0.0.1", "--num_workers", "1"]
    try:
        return start_server("litellm_proxy", argv, "/health/liveliness", env)
    finally:
        config.unlink()  # read at its start


@contextmanager
def bench_database(database_url: str | None) -> Iterator[str]:
    """A fresh database on the given server (default: an embedded one), dropped afterwards."""
    base = database_url or embedded.url(WORK / "postgres-home")
    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = database.with_database(base, name)
    try:
        database.migrate(url)
        yield url
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextmanager
def learning_loop(
    home: Path, model_dir: Path, task: Any, database_url: str | None
) -> Iterator[tuple[str, Any]]:
    """`demo.stack.local_loop` (a `Task`) on free ports and a fresh bench database: yields the
    database URL and the running `Loop`."""
    from demo.stack import local_loop

    with (
        bench_database(database_url) as url,
        local_loop(
            home,
            model_dir,
            database_url=url,
            proxy_port=free_port(),
            vllm_port=free_port(),
            trainer_metrics_port=free_port(),
            task=task,
        ) as loop,
    ):
        yield url, loop


def version_key(v: str) -> int:
    """An X-Policy-Version header as a sortable number ("none" and "?" first)."""
    return int(v) if v.isdigit() else -1


def version_span(versions: set[str]) -> str:
    """The policy versions that served a round, as "3" or "3-5"."""
    ordered = sorted(versions, key=version_key)
    return ordered[0] if len(ordered) == 1 else f"{ordered[0]}-{ordered[-1]}"


def count_transitions(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM transition").fetchone()
    return int(row[0]) if row else 0


def wait_recorded(url: str, expected: int, timeout: float = 60.0) -> tuple[int, float]:
    """Poll until `expected` transitions are stored; (count, seconds waited)."""
    started = time.perf_counter()
    while (n := count_transitions(url)) < expected and time.perf_counter() - started < timeout:
        time.sleep(0.02)
    return n, time.perf_counter() - started


def append_report(path: Path, title: str, module: str, args: Any, lines: Sequence[str]) -> None:
    """Append a dated section to a load benchmark's report: the exact command, the run's
    settings (`args.latency_s`, `seconds`, `rounds`, an optional `note`), then `lines`."""
    settings = (
        f"{os.cpu_count()} cores; fake vLLM latency {args.latency_s * 1e3:g} ms, up to 16 tokens;"
        f" {args.seconds:g} s per target per round, {args.rounds} rounds interleaved."
        + (f" {args.note}" if args.note else "")
        + "\n"
    )
    append_section(path, title, module, [settings, *lines])


def append_section(path: Path, title: str, module: str, lines: Sequence[str]) -> None:
    """Append a dated section to a report: the exact command, then `lines`."""
    command = f"PYTHONPATH=. .venv/bin/python -m {module} " + shlex.join(sys.argv[1:])
    section = [
        f"\n## {time.strftime('%Y-%m-%d %H:%M')}\n",
        f"`{command.strip()}`\n",
        *lines,
        "",
    ]
    if not path.exists():
        path.write_text(f"# {title} (appended by bench/{module.rpartition('.')[2]}.py)\n")
    with path.open("a") as f:
        f.write("\n".join(section))


def load_adapter(vllm_url: str, name: str, path: str) -> None:
    """Load a LoRA adapter into one vLLM under `name`, as a trainer does (core/rollout.py)."""
    asyncio.run(_with_vllm(lambda vllm: rollout.load_everywhere(vllm, [vllm_url], name, path)))


def unload_adapter(vllm_url: str, name: str) -> None:
    asyncio.run(_with_vllm(lambda vllm: rollout.unload_everywhere(vllm, [vllm_url], name)))


async def _with_vllm(call: Callable[[VLLMAdmin], Any]) -> None:
    vllm = VLLMAdmin(api_key=None)
    try:
        await call(vllm)
    finally:
        await vllm.close()
