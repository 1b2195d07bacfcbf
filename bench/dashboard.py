"""The dashboard's queries on a big table: one page's query time at a million transitions.

Fills a fresh database with `--transitions` rows (bench/synthetic.py; default 1,000,000: 4 calls an
episode, 4 agents, 50 tasks, 10 policy versions one after another, spread over `--days` days, 90 %
of episodes rewarded, 1 % failed calls, 0.5 % set aside, no token ids), ANALYZEs it, then times
each query the pages run (proxy/record/store/dashboard.py and the episode read, through the same
functions the routes call), as the operator (every tenant) and as a tenant's key would:

    PYTHONPATH=. .venv/bin/python -m bench.dashboard [--transitions 1000000] [--repeat 5]
        [--database-url URL] [--results bench/dashboard.md]

Prints the median and worst of `--repeat` runs per query and appends them to bench/dashboard.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text

from bench import synthetic
from bench.common import append_section, bench_database
from bench.synthetic import CALLS_PER_EPISODE
from core import database
from core.tenants import OPERATOR, Principal
from proxy.record.store import dashboard
from proxy.record.store.episodes import get_episode

REPORT = Path(__file__).with_name("dashboard.md")


async def timed(fn: Callable[[], Awaitable[Any]], repeat: int) -> tuple[float, float, Any]:
    await fn()  # warm the cache: a dashboard's pages are read again and again
    times = []
    result = None
    for _ in range(repeat):
        start = time.perf_counter()
        result = await fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), max(times), result


async def measure(url: str, repeat: int, episodes: int) -> list[tuple[str, float, float, str]]:
    engine, sessions = database.create_async_sessions(url, pool_size=2)
    rows: list[tuple[str, float, float, str]] = []
    tenant = Principal("acme", frozenset({"read"}))
    now = datetime.now(UTC)

    async def run(
        name: str, fn: Callable[[Any], Awaitable[Any]], what: Callable[[Any], str]
    ) -> None:
        async def once() -> Any:
            async with sessions() as session:
                return await fn(session)

        median, worst, result = await timed(once, repeat)
        rows.append((name, median, worst, what(result)))
        print(f"{name:<58} {median:8.1f} ms median {worst:8.1f} ms worst  {what(result)}")

    def window(hours: float, **kw: Any) -> dashboard.Window:
        return dashboard.Window(since=now - timedelta(hours=hours), until=now, **kw)

    calls = lambda o: f"{sum(b['calls'] for b in o['calls']):,} calls in window"  # noqa: E731

    def overview_of(hours: float) -> Callable[[Any], Awaitable[Any]]:
        return lambda s: dashboard.overview(OPERATOR, window(hours), session=s)

    def episodes_where(where: dashboard.EpisodeFilter) -> Callable[[Any], Awaitable[Any]]:
        return lambda s: dashboard.episodes(OPERATOR, where, limit=50, after=None, session=s)

    for hours in (1, 6, 24, 24 * 7):
        await run(f"overview, last {hours} h, every tenant", overview_of(hours), calls)
    await run(
        "overview, last 24 h, one agent",
        lambda s: dashboard.overview(OPERATOR, window(24, agent="agent-1"), session=s),
        calls,
    )
    await run(
        "overview, last 24 h, a tenant's key",
        lambda s: dashboard.overview(tenant, window(24), session=s),
        calls,
    )
    page = lambda p: f"{len(p['data'])} episodes"  # noqa: E731
    first = dashboard.EpisodeFilter()
    await run(
        "episodes, first page (50)",
        lambda s: dashboard.episodes(OPERATOR, first, limit=50, after=None, session=s),
        page,
    )
    async with sessions() as session:  # a cursor deep in the table: ~half-way back
        mid = await session.execute(
            text(
                "SELECT created_at, id FROM episode ORDER BY created_at LIMIT 1 OFFSET "
                "(SELECT count(*) / 2 FROM episode)"
            )
        )
        at, eid = mid.one()
    deep = dashboard.cursor_of(at, eid)
    await run(
        "episodes, a page half-way back (keyset)",
        lambda s: dashboard.episodes(OPERATOR, first, limit=50, after=deep, session=s),
        page,
    )
    for name, where in [
        ("episodes, by task", dashboard.EpisodeFilter(task="task-7")),
        ("episodes, by agent", dashboard.EpisodeFilter(agent="agent-2")),
        ("episodes, by version (an old one)", dashboard.EpisodeFilter(version=1)),
        ("episodes, reward >= 0.9", dashboard.EpisodeFilter(min_reward=0.9)),
        ("episodes, id prefix 'ep-12345'", dashboard.EpisodeFilter(search="ep-12345")),
    ]:
        await run(name, episodes_where(where), page)
    await run(
        "episodes, a tenant's key, first page",
        lambda s: dashboard.episodes(tenant, first, limit=50, after=None, session=s),
        page,
    )
    await run(
        "one episode (4 calls, messages, rewards)",
        lambda s: get_episode(f"ep-{episodes // 30 * 10 + 1}", session=s),  # not acme's
        lambda r: f"{len(r.transitions) if r else 0} calls",
    )
    await engine.dispose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transitions", type=int, default=1_000_000)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--results", type=Path, default=REPORT)
    args = parser.parse_args()
    with bench_database(args.database_url) as url:
        synthetic.fill(
            url,
            args.transitions // CALLS_PER_EPISODE,
            days=args.days,
            token_ids=False,  # the pages never read them
            rewarded=0.9,
            tenant=True,
            versions=10,
            trained_after_h=1,
            failed=0.01,
            set_aside=0.005,
        )
        rows = asyncio.run(measure(url, args.repeat, args.transitions // CALLS_PER_EPISODE))
    lines = [
        f"{args.transitions:,} transitions ({args.transitions // CALLS_PER_EPISODE:,} episodes)"
        f" over {args.days:g} days; median and worst of {args.repeat} warm runs.\n",
        "| query | median ms | worst ms | result |",
        "|---|---|---|---|",
        *[f"| {n} | {m:.1f} | {w:.1f} | {r} |" for n, m, w, r in rows],
    ]
    append_section(args.results, "Dashboard queries", "bench.dashboard", lines)


if __name__ == "__main__":
    main()
