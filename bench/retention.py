"""Retention at a million transitions: the size before and after dropping half of 30 days, how
long that takes, and a proxy recording through it without losing a call.

    PYTHONPATH=. .venv/bin/python -m bench.retention [--transitions 1000000] [--days 30]
        [--keep 15] [--clients 8] [--database-url URL] [--results bench/retention.md]

1. A fresh database; the days' partitions made first (as the proxy makes them ahead), then
   `--transitions` rows over `--days` days (bench/synthetic.py): 4 calls an episode with 300 prompt
   and 12 completion token ids, each call naming a shared system prompt and its episode's own
   question (stored once, marked used on its episode's day, as the writer marks it), a final reward
   per episode and a step reward on one call in four; trained, except the last two days.
2. A proxy in front of the fake vLLM takes `--clients` clients calling back to back. After
   `--settle-s` seconds, `retain --days KEEP` runs (core/retention.py, what `flywheel retain`
   and FLYWHEEL_RETENTION_DAYS run); the load goes on for `--settle-s` seconds more.
3. Reported: sizes of each table before and after (and after a VACUUM of the tables rows were
   deleted from), the time retention took, the calls answered against the transitions stored,
   and call latency before, during and after the drop.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from bench import common, synthetic
from bench.common import append_section, bench_database, quantile
from bench.synthetic import CALLS_PER_EPISODE, COMPLETION_IDS, PROMPT_IDS
from core import database, retention
from fakes import processes

REPORT = Path(__file__).with_name("retention.md")


class Calls:
    """Each call's (start, latency or None when it failed), from clients calling back to back."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.clients = url, clients
        self.done: list[tuple[float, float | None]] = []
        self.tag = uuid.uuid4().hex[:8]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    def __enter__(self) -> Calls:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()

    async def _run(self) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(self._client(session, n) for n in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession, n: int) -> None:
        headers = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {common.MASTER_KEY}",
            "X-Episode-Id": f"live-{self.tag}-{n}",
        }
        i = 0
        while not self._stop.is_set():
            body = common.chat_body(
                [{"role": "user", "content": f"call {i} of client {n}"}], stream=False
            )
            started = time.perf_counter()
            try:
                async with session.post(self.url, data=body, headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            self.done.append((started, time.perf_counter() - started if ok else None))
            i += 1


def latency_line(name: str, calls: list[tuple[float, float | None]]) -> str:
    ok = [latency * 1000 for _, latency in calls if latency is not None]
    failed = len(calls) - len(ok)
    return (
        f"| {name} | {len(calls):,} | {failed} | {quantile(ok, 0.5):.1f} | "
        f"{quantile(ok, 0.99):.1f} | {max(ok, default=float('nan')):.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transitions", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--keep", type=int, default=15)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--results", type=Path, default=REPORT)
    args = parser.parse_args()
    with bench_database(args.database_url) as url:
        synthetic.fill(
            url,
            args.transitions // CALLS_PER_EPISODE,
            days=args.days,
            question="episode",  # each episode's own, for retention to drop with its day
            trained_after_h=48,
        )
        engine, _ = database.create_sessions(url)
        fake = processes.start_fake(0.005)
        proxy = processes.start_flywheel(fake.url, url)
        try:
            with Calls(proxy.url + "/v1/chat/completions", args.clients) as calls:
                time.sleep(args.settle_s)
                began = time.perf_counter()
                done = retention.retain(engine, url, days=args.keep)
                ended = time.perf_counter()
                time.sleep(args.settle_s)
            answered = sum(1 for _, latency in calls.done if latency is not None)
            stored, waited = _wait_live(url, calls.tag, answered)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("VACUUM message, episode, reward")
            vacuumed = retention.sizes(engine)
        finally:
            proxy.stop()
            fake.stop()
            engine.dispose()
    dropped = [d for d in done.decisions if d.action == "drop"]
    rows = sum(d.rows for d in dropped)
    print(f"retention: {len(dropped)} days, {rows:,} transitions in {ended - began:.2f} s")
    print(f"calls answered {answered:,}, stored {stored:,} (waited {waited:.1f} s)")
    mib = 2**20
    lines = [
        f"{args.transitions:,} transitions over {args.days} days ({PROMPT_IDS}+{COMPLETION_IDS}"
        f" token ids a call, 2 messages a call: a shared system prompt and the episode's own);"
        f" `retain --days {args.keep}` while {args.clients} clients call a proxy (fake vLLM,"
        " 5 ms).\n",
        f"Dropped {len(dropped)} days ({rows:,} transitions) in **{ended - began:.2f} s**; "
        f"deleted {done.episodes:,} episodes, {done.rewards:,} rewards, {done.messages:,}"
        " messages. Steps: "
        + ", ".join(f"{step} {s:.1f} s" for step, s in done.seconds.items())
        + ".\n",
        "| table | before MiB | after MiB | after VACUUM MiB |",
        "|---|---|---|---|",
        *[
            f"| {t} | {done.bytes_before[t] / mib:,.1f} | {done.bytes_after[t] / mib:,.1f} | "
            f"{vacuumed[t] / mib:,.1f} |"
            for t in retention.TABLES
        ],
        f"| all | {sum(done.bytes_before.values()) / mib:,.1f} | "
        f"{sum(done.bytes_after.values()) / mib:,.1f} | {sum(vacuumed.values()) / mib:,.1f} |",
        "",
        f"Recording meanwhile: **{answered:,} calls answered, {stored:,} stored"
        f" ({answered - stored} lost)**.\n",
        "| calls started | calls | failed | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|",
        latency_line("before retention", [c for c in calls.done if c[0] < began]),
        latency_line("during retention", [c for c in calls.done if began <= c[0] < ended]),
        latency_line("after retention", [c for c in calls.done if c[0] >= ended]),
    ]
    append_section(args.results, "Retention", "bench.retention", lines)
    print("\n".join(lines))


def _wait_live(url: str, tag: str, expected: int, timeout: float = 60) -> tuple[int, float]:
    started = time.perf_counter()
    sql = "SELECT count(*) FROM transition WHERE episode_id LIKE %s"
    while True:
        with psycopg.connect(url) as conn:
            row = conn.execute(sql, (f"live-{tag}-%",)).fetchone()
        n = int(row[0]) if row else 0
        if n >= expected or time.perf_counter() - started > timeout:
            return n, time.perf_counter() - started
        time.sleep(0.1)


if __name__ == "__main__":
    main()
