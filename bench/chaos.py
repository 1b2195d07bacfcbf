"""The chaos suite: faults under steady traffic; what the clients were told against what Postgres
holds afterwards.

    PYTHONPATH=. .venv/bin/python -m bench.chaos [--faults pg-stop,pg-kill,...] [--outage-s 60]
        [--clients 8] [--note "..."]

The stack: an embedded Postgres of its own (fakes/pg.py, to stop and kill), two fake vLLM
replicas (fakes/vllm.py, 5 ms) and one `flywheel proxy`, each a process. The traffic: N
clients, each playing episodes of two chat calls (the second streamed) and then posting the
episode's final reward with an idempotency key, retrying a 503 or a refused connection for up to
10 s as a client should. An answer with X-Transition-Id acknowledges those transitions; a 200
(stored) or a 202 (journaled) to the reward acknowledges it. After each fault is healed (and a
restarted proxy has replayed its journal), every acknowledged transition and reward is looked for
in Postgres.

Faults (`--faults`, all by default):
  pg-stop        Postgres stopped for --outage-s, then started
  pg-kill        Postgres kill -9 (crash recovery at restart) for --outage-s / 4
  journal-full   the journal on a 64 KiB tmpfs, Postgres stopped for --outage-s / 4
  journal-ro     the journal's filesystem remounted read-only, Postgres stopped likewise
  proxy-term     the proxy SIGTERMed (graceful) and started again
  proxy-kill     the proxy kill -9ed and started again (default mode)
  proxy-kill-durable   the same with FLYWHEEL_DURABLE=true
  vllm-kill      one vLLM replica kill -9ed for --outage-s / 4, then started again
  reward-burst   10,000 rewards in one post while the traffic runs
  trainer-kill-step     a `flywheel trainer` training on the traffic kill -9ed while it holds
                        a claimed batch, and started again
  trainer-kill-publish  the same while it publishes (its adapter written and loading into
                        vLLM, not yet recorded: the fakes take 2 s per load here)
And the faults of bench/chaos_more.py (its docstring): pg-disk-full, pg-partition,
vllm-partition, pg-stop+proxy-term, journal-full+proxy-kill, proxy-oom.
The journal faults need root (a tmpfs mount) and are skipped without it, as are
chaos_more's (iptables, cgroups). For the trainer faults
the note says what became of the killed trainer's claims and its half-published adapter, and
whether the versions still form one chain; anything wrong there starts with "FAILED".

Prints the table and appends it to bench/chaos.md; docs/reliability.md explains it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import psycopg

from bench import chaos_more, common
from demo.tiny_model import build_demo_model
from demo.vllm_server import free_port
from fakes import netfault, processes
from fakes.pg import OwnPostgres

RESULTS = Path(__file__).with_suffix(".md")
PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]
JSON = {"Content-Type": "application/json"}
RETRY_S = 10.0  # how long a client keeps retrying a reward the proxy answered 503
BURST = 10_000
FAULTS = (
    "pg-stop",
    "pg-kill",
    "journal-full",
    "journal-ro",
    "proxy-term",
    "proxy-kill",
    "proxy-kill-durable",
    "vllm-kill",
    "reward-burst",
    "trainer-kill-step",
    "trainer-kill-publish",
    *chaos_more.FAULTS,
)
NEEDS_ROOT = ("journal-full", "journal-ro", *chaos_more.FAULTS)
JOURNAL_TMPFS = ("journal-full", "journal-ro", "journal-full+proxy-kill")
TRAINER_FAULTS = ("trainer-kill-step", "trainer-kill-publish")
TRAINER_SETTINGS = {  # small steps, a short lease and frequent reconciles: the fault's effects
    "FLYWHEEL_LEASE_S": "10",  # show within the run
    "FLYWHEEL_RECONCILE_S": "2",
    "FLYWHEEL_POLL_S": "0.2",
    "FLYWHEEL_MIN_EPISODES": "8",
    "FLYWHEEL_MAX_BATCH_TRANSITIONS": "64",
    "FLYWHEEL_LOG_LEVEL": "info",
    "OMP_NUM_THREADS": "1",
}
LOAD_DELAY_S = 2.0  # the fakes' adapter loads, in the trainer runs (a window to kill in)


# --- the stack ---------------------------------------------------------------------------------


@dataclass
class Stack:
    pg: OwnPostgres
    fakes: list[processes.Server]
    home: Path
    settings: dict[str, str]
    port: int = field(default_factory=free_port)
    proxy: processes.Server | None = None
    trainer: processes.Server | None = None
    proxy_python: str = sys.executable  # (proxy-oom: one that joins a memory cgroup first)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_proxy(self) -> None:
        self.proxy = processes.start_flywheel(
            [f.url for f in self.fakes],
            self.pg.url,
            home=self.home,
            settings=self.settings,
            port=self.port,
            python=self.proxy_python,
        )

    def start_trainer(self) -> None:
        model = build_demo_model(processes.WORK / "models" / "demo")
        self.trainer = processes.start_trainer(
            model,
            [f.url for f in self.fakes],
            self.pg.url,
            home=self.home,
            settings=TRAINER_SETTINGS,
            log_name="chaos_trainer",
        )

    @property
    def trainer_id(self) -> str:
        assert self.trainer is not None
        return f"{socket.gethostname()}-{self.trainer.process.pid}"  # (its default id)

    def restart_fake(self, index: int) -> None:
        port = int(self.fakes[index].url.rsplit(":", 1)[1])
        self.fakes[index] = processes.start_fake(0.005, always_detail=False, port=port)

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()
        if self.proxy is not None:
            self.proxy.stop()
        for fake in self.fakes:
            fake.stop()


@contextmanager
def stack(
    work: Path,
    *,
    durable: bool = False,
    journal_tmpfs: bool = False,
    trainer: bool = False,
    pg_tcp: bool = False,
    pg_disk_mb: int | None = None,
    token_delay_s: float = 0.0,
    proxy_python: str = sys.executable,
) -> Iterator[Stack]:
    home = Path(tempfile.mkdtemp(prefix="flywheel-chaos-", dir=work))
    journal = home / "journal"
    journal.mkdir()
    if journal_tmpfs:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(journal)], check=True
        )
    pg = OwnPostgres(work, tcp_port=free_port() if pg_tcp else None, disk_mb=pg_disk_mb)
    delay = LOAD_DELAY_S if trainer else 0.0
    fakes = [
        processes.start_fake(0.005, token_delay_s, always_detail=False, load_delay_s=delay)
        for _ in range(2)
    ]
    settings = {"FLYWHEEL_JOURNAL_RETRY_S": "0.5", "FLYWHEEL_REPLICA_PROBE_S": "0.5"}
    if durable:
        settings["FLYWHEEL_DURABLE"] = "true"
    s = Stack(pg, fakes, home, settings, proxy_python=proxy_python)
    try:
        s.start_proxy()
        if trainer:
            s.start_trainer()
        yield s
    finally:
        s.close()
        pg.close()
        if journal_tmpfs:
            subprocess.run(["umount", "-l", str(journal)], check=False)
        shutil.rmtree(home, ignore_errors=True)


# --- the traffic -------------------------------------------------------------------------------


@dataclass
class Traffic:
    """N clients in a background thread until stop(); what they were told."""

    url: str
    clients: int
    pause_s: float = 0.0  # between a client's episodes (a steady rate for the soak)
    long_prompts: bool = False  # 20-50 KB prompts, no X-Episode-Id, no rewards (proxy-oom)
    transitions: set[str] = field(default_factory=set)  # acknowledged
    rewards: set[str] = field(default_factory=set)  # episode ids whose reward was acknowledged
    errors: Counter[str] = field(default_factory=Counter)  # what the clients were told instead
    calls: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, n) for n in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession, n: int) -> None:
        tag = uuid.uuid4().hex[:6]
        i = 0
        rewards: set[asyncio.Task[None]] = set()  # retried alongside the next episodes' calls
        while not self._stop.is_set():
            episode = f"chaos-{tag}-{n}-{i}"
            i += 1
            for stream in (False, True):
                await self._call(session, episode, stream, task=f"chaos-{i % 8}")
            if self.long_prompts:
                continue
            # (half rewarded 1, half 0: GRPO groups with something to learn, for the trainer)
            task = asyncio.create_task(self._reward(session, episode, float(i % 2)))
            rewards.add(task)
            task.add_done_callback(rewards.discard)
            if self.pause_s:
                await asyncio.sleep(self.pause_s)
        await asyncio.gather(*rewards)

    async def _call(
        self, session: aiohttp.ClientSession, episode: str, stream: bool, task: str
    ) -> None:
        prompt, headers = PROMPT, {**JSON, "X-Episode-Id": episode, "X-Task-Id": task}
        if self.long_prompts:  # each one different: nothing shared to deduplicate
            size = random.randrange(20_000, 50_000)
            text = (episode + " " + uuid.uuid4().hex + " ") * (size // 45)
            prompt, headers = [{"role": "user", "content": text}], JSON
        body = common.chat_body(prompt, stream=stream, max_tokens=8, model="policy")
        self.calls += 1
        try:
            async with session.post(
                f"{self.url}/v1/chat/completions", data=body, headers=headers
            ) as r:
                data = await r.read()
                complete = not stream or data.rstrip().endswith(b"data: [DONE]")
                if r.status == 200 and complete:
                    self.transitions.update(r.headers["X-Transition-Id"].split(","))
                else:
                    self.errors[f"call {r.status}{'' if complete else ' (cut)'}"] += 1
        except (aiohttp.ClientError, TimeoutError) as e:
            self.errors[f"call {type(e).__name__}"] += 1
            await asyncio.sleep(0.2)

    async def _reward(self, session: aiohttp.ClientSession, episode: str, reward: float) -> None:
        body = orjson.dumps({"episode_id": episode, "reward": reward, "idempotency_key": "final"})
        deadline = time.monotonic() + RETRY_S
        told = ""
        while time.monotonic() < deadline:  # (the episode's reward is posted, even at stop)
            try:
                async with session.post(self.url + "/v1/rewards", data=body, headers=JSON) as r:
                    await r.read()
                    if r.status in (200, 202):  # 202: journaled (fsync'd), stored at replay
                        self.rewards.add(episode)
                        return
                    told = f"reward {r.status}"
                    if r.status != 503:
                        break
            except (aiohttp.ClientError, TimeoutError) as e:
                told = f"reward {type(e).__name__}"
            await asyncio.sleep(0.5)
        self.errors[told] += 1


# --- counting ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    fault: str
    seconds: float
    transitions: int
    transitions_lost: int
    rewards: int
    rewards_lost: int
    errors: Counter[str]
    note: str = ""

    def row(self) -> str:
        told = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"
        return (
            f"| {self.fault} | {self.seconds:.0f} | {self.transitions} "
            f"| {self.transitions - self.transitions_lost} | {self.transitions_lost} "
            f"| {self.rewards} | {self.rewards - self.rewards_lost} | {self.rewards_lost} "
            f"| {told} | {self.note} |"
        )


STORED_TRANSITIONS = "SELECT id::text FROM transition WHERE id = ANY(%s::uuid[])"
STORED_REWARDS = (
    "SELECT episode_id FROM reward WHERE episode_id = ANY(%s) "
    "AND idempotency_key IN ('final', 'burst')"
)


def lost(
    db: str, traffic: Traffic, extra_rewards: set[str], timeout: float = 120
) -> tuple[int, int]:
    """Acknowledged transitions and rewards not in Postgres, once it has had `timeout` to
    catch up (journal replays included)."""
    rewards = traffic.rewards | extra_rewards
    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(db, connect_timeout=5) as conn:
                ids = list(traffic.transitions)
                have_t = {r[0] for r in conn.execute(STORED_TRANSITIONS, (ids,)).fetchall()}
                have_r = {r[0] for r in conn.execute(STORED_REWARDS, (list(rewards),)).fetchall()}
        except psycopg.OperationalError:
            have_t, have_r = set(), set()
        missing = (len(traffic.transitions - have_t), len(rewards - have_r))
        if missing == (0, 0) or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)


# --- the faults ----------------------------------------------------------------------------------


def run_fault(fault: str, args: argparse.Namespace, work: Path) -> Outcome:
    options: dict[str, Any] = {
        "durable": fault == "proxy-kill-durable",
        "journal_tmpfs": fault in JOURNAL_TMPFS,
        "trainer": fault in TRAINER_FAULTS,
        "pg_tcp": fault == "pg-partition",
        "pg_disk_mb": chaos_more.PG_DISK_MB if fault == "pg-disk-full" else None,
        "token_delay_s": chaos_more.STREAM_TOKEN_DELAY_S if fault == "vllm-partition" else 0.0,
    }
    with contextlib.ExitStack() as cgroup:
        if fault == "proxy-oom":
            python = cgroup.enter_context(chaos_more.memory_cgroup(args.oom_limit_mb, work))
            options["proxy_python"] = python
        return run_in(stack(work, **options), fault, args)


def run_in(
    the_stack: contextlib.AbstractContextManager[Stack], fault: str, args: argparse.Namespace
) -> Outcome:
    with the_stack as s:
        traffic = Traffic(s.url, args.clients, long_prompts=fault == "proxy-oom").start()
        time.sleep(args.warm_s)
        started = time.monotonic()
        extra: set[str] = set()
        if fault in chaos_more.FAULTS:
            try:
                note = chaos_more.inject(fault, s, args, traffic)
            finally:
                netfault.clear_partitions()
        else:
            note = inject(fault, s, args.outage_s, extra)
        time.sleep(args.warm_s)  # traffic on the healed stack
        traffic.stop()
        seconds = time.monotonic() - started
        t_lost, r_lost = lost(s.pg.url, traffic, extra)
        if (t_lost or r_lost) and s.proxy is not None:  # kept: the next fault's proxy truncates it
            kept = processes.WORK / "chaos" / f"{fault}-proxy.log"
            shutil.copyfile(s.proxy.log_path, kept)
            post_mortem(s, kept.with_name(f"{fault}-post-mortem.txt"))
            note += f"; the proxy's log kept in {kept}, what held it up beside it"
        return Outcome(
            fault,
            seconds,
            len(traffic.transitions),
            t_lost,
            len(traffic.rewards | extra),
            r_lost,
            traffic.errors,
            note,
        )


POST_MORTEM = {  # what tells a stuck journal replay's causes apart (a lock, a writer, an error)
    "backends": "SELECT pid, state, wait_event_type, wait_event, pg_blocking_pids(pid), "
    "backend_start, xact_start, state_change, left(query, 120) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid()",
    "ungranted locks": "SELECT pid, locktype, mode, relation::regclass, transactionid "
    "FROM pg_locks WHERE NOT granted",
}


def post_mortem(s: Stack, path: Path) -> None:
    """After a loss: the server's backends and waiting locks, the proxy's journal metrics and
    the journal's files, before the stack (and with it all of these) is torn down."""
    lines: list[str] = []
    try:
        with psycopg.connect(s.pg.url, connect_timeout=5) as conn:
            for title, sql in POST_MORTEM.items():
                lines += [f"## {title}", *(repr(r) for r in conn.execute(sql).fetchall())]
    except psycopg.Error as e:
        lines.append(f"## Postgres: {e!r}")
    try:
        text = httpx.get(s.url + "/metrics", timeout=5).text
        keep = ("flywheel_journal", "flywheel_database_up", "flywheel_transitions_")
        lines += ["## metrics", *(m for m in text.splitlines() if m.startswith(keep))]
    except httpx.HTTPError as e:
        lines.append(f"## metrics: {e!r}")
    journal = s.home / "journal"
    files = sorted(p for p in journal.rglob("*") if p.is_file()) if journal.exists() else []
    lines += ["## journal", *(f"{p.relative_to(journal)} {p.stat().st_size}" for p in files)]
    path.write_text("\n".join(lines) + "\n")


def inject(fault: str, s: Stack, outage_s: float, extra_rewards: set[str]) -> str:
    """Do the fault and heal it; returns a note for the table."""
    assert s.proxy is not None
    short = max(1.0, outage_s / 4)
    if fault == "pg-stop":
        s.pg.stop()
        time.sleep(outage_s)
        s.pg.start()
    elif fault == "pg-kill":
        s.pg.kill()
        time.sleep(short)
        s.pg.start()
    elif fault in ("journal-full", "journal-ro"):
        if fault == "journal-ro":
            subprocess.run(["mount", "-o", "remount,ro", str(s.home / "journal")], check=True)
        s.pg.stop()
        time.sleep(short)
        # evidence that the journal did fail meanwhile
        failed = common.metric(s.url, "flywheel_journal_errors_total")
        s.pg.start()
        if fault == "journal-ro":
            subprocess.run(["mount", "-o", "remount,rw", str(s.home / "journal")], check=True)
        return f"journal writes failed {failed:.0f} times; those records waited in memory"
    elif fault in ("proxy-term", "proxy-kill", "proxy-kill-durable"):
        sig = signal.SIGTERM if fault == "proxy-term" else signal.SIGKILL
        s.proxy.process.send_signal(sig)
        s.proxy.process.wait(timeout=90)
        time.sleep(1.0)
        s.start_proxy()  # the same FLYWHEEL_HOME: it replays what its predecessor journaled
    elif fault == "vllm-kill":
        s.fakes[0].process.send_signal(signal.SIGKILL)
        s.fakes[0].process.wait()
        time.sleep(short)
        s.restart_fake(0)
    elif fault == "reward-burst":
        episodes = [f"burst-{uuid.uuid4().hex[:8]}-{i}" for i in range(BURST)]
        body = [{"episode_id": e, "reward": 0.5, "idempotency_key": "burst"} for e in episodes]
        started = time.monotonic()
        r = httpx.post(s.url + "/v1/rewards", content=orjson.dumps(body), headers=JSON, timeout=300)
        took = time.monotonic() - started
        if r.status_code == 200:
            extra_rewards.update(episodes)
        return f"{BURST} rewards in one post: {r.status_code} in {took:.1f} s"
    elif fault in TRAINER_FAULTS:
        return kill_trainer(s, mid_publish=fault == "trainer-kill-publish")
    else:
        raise ValueError(f"unknown fault {fault!r}")
    return ""


# --- the trainer faults ------------------------------------------------------------------------


def kill_trainer(s: Stack, *, mid_publish: bool) -> str:
    """kill -9 the trainer mid-step or mid-publish, start another; then check what the killed
    one left: its claims taken over after the lease, its unrecorded adapter unloaded and deleted
    once orphaned, every trained row in a recorded version, the versions one chain."""
    assert s.trainer is not None
    adapters = s.home / "adapters"
    with psycopg.connect(s.pg.url, autocommit=True) as db:
        wait_for(lambda: recorded(db), 300, "the trainer's first version")  # steady state
        dead = s.trainer_id

        def held() -> int:
            return int(db.execute(HELD, (dead,)).fetchone()[0])  # type: ignore[index]

        def unrecorded() -> set[str]:
            on_disk = {p.name for p in adapters.glob("policy-v*")}
            return on_disk - set(recorded(db))

        if mid_publish:  # written, loading into vLLM, not yet recorded
            wait_for(lambda: held() > 0 and unrecorded(), 300, "a publish")
        else:  # claimed, not yet written
            wait_for(lambda: held() > 0 and not unrecorded(), 300, "a step")
        half_published = unrecorded()
        claims = held()
        s.trainer.process.send_signal(signal.SIGKILL)
        s.trainer.process.wait()
        killed = time.monotonic()
        last = max(recorded(db).values())
        s.start_trainer()
        ready = time.monotonic() - killed
        lease = float(TRAINER_SETTINGS["FLYWHEEL_LEASE_S"])
        timeout = lease + 240
        wait_for(lambda: held() == 0, timeout, "the killed trainer's claims to be taken over")
        taken_over = time.monotonic() - killed
        wait_for(lambda: max(recorded(db).values()) > last, timeout, "a version after the kill")
        problems = []
        if half_published:  # orphaned after a lease: unloaded from every vLLM, deleted

            def gone() -> bool:
                return not (half_published & (loaded(s) | unrecorded()))

            if not wait_for(gone, timeout, "", fail=False):
                problems.append(f"{sorted(half_published)} still loaded or on disk")
        stray = db.execute(TRAINED_OUTSIDE_A_VERSION).fetchone()[0]  # type: ignore[index]
        if stray:
            problems.append(f"{stray} rows trained into no recorded version")
        chain = db.execute(LINEAGE).fetchall()
        broken = [v for (before, _), (v, parent) in itertools.pairwise(chain) if parent != before]
        if broken or (chain and chain[0][1] is not None):
            problems.append(f"versions {broken} do not descend from the one before")
    what = "publish of " + ", ".join(sorted(half_published)) if mid_publish else "step"
    note = (
        f"killed mid-{what} holding {claims} claims; its successor (up after {ready:.0f} s) "
        f"took them over {taken_over:.0f} s after the kill (lease {lease:g} s); "
        f"v1..v{chain[-1][0]} one chain"
        + ("; the half-published adapter unloaded and deleted" if half_published else "")
    )
    return "; ".join(["FAILED: " + ", ".join(problems), note] if problems else [note])


HELD = "SELECT count(*) FROM transition WHERE claimed_by = %s AND trained_at IS NULL"
TRAINED_OUTSIDE_A_VERSION = (
    "SELECT count(*) FROM transition t WHERE trained_version IS NOT NULL AND NOT EXISTS "
    "(SELECT 1 FROM adapter_version a WHERE a.version = t.trained_version)"
)
LINEAGE = "SELECT version, (stats->>'parent')::int FROM adapter_version ORDER BY version"


def recorded(db: psycopg.Connection[tuple[object, ...]]) -> dict[str, int]:
    return {str(n): int(v) for n, v in db.execute("SELECT name, version FROM adapter_version")}  # type: ignore[call-overload]


def loaded(s: Stack) -> set[str]:
    names: set[str] = set()
    for fake in s.fakes:
        names |= {m["id"] for m in httpx.get(fake.url + "/v1/models", timeout=10).json()["data"]}
    return names


def wait_for(ready: Callable[[], object], timeout: float, what: str, *, fail: bool = True) -> bool:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            if fail:
                raise TimeoutError(f"no {what} in {timeout:.0f} s")
            return False
        time.sleep(0.05)
    return True


# --- the report --------------------------------------------------------------------------------


HEADER = [
    "| fault | s | transitions acknowledged | stored | lost | rewards acknowledged | stored "
    "| lost | what clients were told instead | note |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--faults", default=",".join(FAULTS), type=lambda s: [f for f in s.split(",") if f]
    )
    parser.add_argument("--outage-s", type=float, default=60.0)
    parser.add_argument("--warm-s", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--oom-s", type=float, default=120.0, help="proxy-oom's traffic")
    parser.add_argument("--oom-limit-mb", type=int, default=512, help="proxy-oom's cgroup")
    parser.add_argument("--note")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    work = processes.WORK / "chaos"
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for fault in args.faults:
        if fault in NEEDS_ROOT and os.geteuid() != 0:
            rows.append(f"| {fault} | - | skipped: needs root (tmpfs, iptables, cgroups) |||||||")
            continue
        outcome = run_fault(fault, args, work)
        rows.append(outcome.row())
        print(rows[-1], flush=True)
    lines = [
        f"{args.clients} clients; Postgres outage {args.outage_s:g} s (pg-stop), "
        f"{max(1.0, args.outage_s / 4):g} s (the others); {args.warm_s:g} s of traffic before "
        "and after each fault." + (f" {args.note}" if args.note else ""),
        "",
        *HEADER,
        *rows,
    ]
    print("\n".join(lines))
    common.append_section(args.results, "Chaos suite", "bench.chaos", lines)


if __name__ == "__main__":
    main()
