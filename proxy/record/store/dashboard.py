"""The dashboard's SQL (read only): the overview's aggregates over a time window, and the episode
list a keyset page at a time. Every query is limited to the rows the caller may see
(`Principal.owns_episode_sql`) and reads an index by time (migration 0009), so a page costs the
same at a million transitions as at a thousand (bench/dashboard.py measures it).

Functions take `*, session` and return JSON-ready values; proxy/routes/ui.py serves them.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from core.tenants import Principal
from core.trainable import REASONS, Share, fates_sql, shares

BUCKETS = 60  # points per series, whatever the window
# An agent with fewer calls than this (the caller's) has its episodes listed from its index
# first; with more, each episode the page walks is probed (they are everywhere).
RARE_AGENT_CALLS = 10_000


@dataclass(frozen=True)
class Window:
    since: datetime
    until: datetime
    agent: str | None = None
    task: str | None = None  # stored id (the caller's own, namespaced)

    @property
    def bucket_s(self) -> int:
        return max(1, int((self.until - self.since).total_seconds() // BUCKETS))

    def params(self) -> dict[str, Any]:
        return {"since": self.since, "until": self.until, "agent": self.agent, "task": self.task}


_IN_WINDOW = """t.requested_at >= :since AND t.requested_at < :until
  AND (CAST(:agent AS text) IS NULL OR t.agent_name = :agent)
  AND (CAST(:task AS text) IS NULL OR t.task_id = :task)"""


async def overview(
    principal: Principal, window: Window, *, session: AsyncSession
) -> dict[str, Any]:
    """Calls, rewards and versions in the window, what it was called with, the trainer's queue."""
    owns_t, p = principal.owns_episode_sql("t.episode_id")
    owns_e, _ = principal.owns_episode_sql("e.id")
    p |= window.params() | {"bucket": window.bucket_s, "origin": window.since}
    calls = await session.execute(
        text(f"""
SELECT date_bin(make_interval(secs => :bucket), t.requested_at, :origin) AS at,
       count(*) AS calls, count(*) FILTER (WHERE t.status <> 'ok') AS failed
FROM transition t WHERE {_IN_WINDOW} AND {owns_t}
GROUP BY 1 ORDER BY 1"""),
        p,
    )
    rewards = await session.execute(
        text(f"""
SELECT date_bin(make_interval(secs => :bucket), e.created_at, :origin) AS at,
       count(*) AS episodes, count(e.final_reward) AS rewarded, avg(e.final_reward) AS mean
FROM episode e
WHERE e.created_at >= :since AND e.created_at < :until AND {owns_e}
  AND (CAST(:task AS text) IS NULL OR e.task_id = :task)
  AND (CAST(:agent AS text) IS NULL OR EXISTS (
        SELECT 1 FROM transition t WHERE t.episode_id = e.id AND t.agent_name = :agent))
GROUP BY 1 ORDER BY 1"""),
        p,
    )
    versions = await reward_per_version(principal, window, session=session)
    # Who called and on which tasks: one pass over the window. (The agent/task filters apply to
    # the series; the choices stay the window's.)
    facets = await session.execute(
        text(f"""
SELECT GROUPING(t.agent_name) = 0 AS by_agent, t.agent_name, t.task_id, count(*) AS n
FROM transition t
WHERE t.requested_at >= :since AND t.requested_at < :until AND {owns_t}
GROUP BY GROUPING SETS ((t.agent_name), (t.task_id))"""),
        p,
    )
    # What became training data, and why the rest did not (core/trainable.py).
    fates = await session.execute(text(fates_sql(f"{_IN_WINDOW} AND {owns_t}")), p)
    share, _ = shares([(fate, lineage, n) for fate, lineage, n in fates])
    queue = await session.execute(
        text(f"""
SELECT t.lineage, count(*) AS trainable, min(t.policy_version) AS oldest_version,
       min(t.credited_at) AS oldest_credited_at
FROM transition t
WHERE t.status = 'ok' AND t.credited_at IS NOT NULL AND t.trained_at IS NULL
  AND t.skip_reason IS NULL AND {owns_t}
GROUP BY 1 ORDER BY 1"""),
        p,
    )
    demonstrations = await session.execute(
        text(f"""
SELECT lineage, count(*), count(*) FILTER (WHERE epochs > 0), max(epochs),
       count(*) FILTER (WHERE epochs = 0 AND skip_reason IS NULL),
       count(*) FILTER (WHERE skip_reason IS NOT NULL), max(created_at)
FROM demonstration WHERE {_demonstrations_of(principal)}
GROUP BY 1 ORDER BY 1"""),
        {"tenant": principal.tenant},
    )
    agents, tasks = [], []
    for by_agent, agent, task, n in facets:
        if by_agent:
            agents.append({"agent": agent, "calls": n})
        else:
            tasks.append({"task": principal.public(task) if task else None, "calls": n})
    return {
        "since": window.since.isoformat(),
        "until": window.until.isoformat(),
        "bucket_s": window.bucket_s,
        "calls": [{"at": at.isoformat(), "calls": n, "failed": failed} for at, n, failed in calls],
        "rewards": [
            {"at": at.isoformat(), "episodes": n, "rewarded": r, "mean": mean}
            for at, n, r, mean in rewards
        ],
        "versions": versions,
        "agents": sorted(agents, key=lambda a: -a["calls"]),
        "tasks": sorted(tasks, key=lambda t: -t["calls"]),
        "training": training_json(share),
        "queue": [
            {
                "lineage": lin,
                "trainable": n,
                "oldest_version": oldest,
                "oldest_credited_at": at.isoformat() if at else None,
            }
            for lin, n, oldest, at in queue
        ],
        "demonstrations": [
            {
                "lineage": lineage,
                "total": total,
                "trained": trained,
                "epochs": epochs,
                "waiting": waiting,
                "set_aside": set_aside,
                "newest": newest.isoformat(),
            }
            for lineage, total, trained, epochs, waiting, set_aside, newest in demonstrations
        ],
    }


def _demonstrations_of(principal: Principal) -> str:
    """The demonstrations `principal` may see: its tenant's (the operator: every one)."""
    if principal.every_tenant:
        return "TRUE"
    return "tenant IS NULL" if principal.tenant is None else "tenant = :tenant"


async def reward_per_version(
    principal: Principal, window: Window, *, session: AsyncSession
) -> list[dict[str, Any]]:
    """Each (lineage, version)'s episodes in the window and their final reward; an episode counts
    once for every version that served one of its calls (the adapters page reads only this)."""
    owns_t, p = principal.owns_episode_sql("t.episode_id")
    rows = await session.execute(
        text(f"""
WITH served AS (
    SELECT DISTINCT t.lineage, t.policy_version, t.episode_id FROM transition t
    WHERE {_IN_WINDOW} AND {owns_t} AND t.policy_version IS NOT NULL
)
SELECT s.lineage, s.policy_version AS version, count(*) AS episodes,
       count(e.final_reward) AS rewarded, avg(e.final_reward) AS mean,
       stddev_samp(e.final_reward) AS sd
FROM served s JOIN episode e ON e.id = s.episode_id
GROUP BY 1, 2 ORDER BY 1, 2"""),
        p | window.params(),
    )
    return [
        {"lineage": lin, "version": v, "episodes": n, "rewarded": r, "mean": m, "sd": sd}
        for lin, v, n, r, m, sd in rows
    ]


@dataclass(frozen=True)
class EpisodeFilter:
    search: str | None = None  # an episode id or the start of one (the caller's public form)
    task: str | None = None  # stored id
    agent: str | None = None
    version: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    since: datetime | None = None
    until: datetime | None = None


class BadCursor(ValueError):
    pass


def cursor_of(created_at: datetime, episode_id: str) -> str:
    raw = f"{created_at.isoformat()}|{episode_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _parse_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, _, episode_id = raw.partition("|")
        return datetime.fromisoformat(at), episode_id
    except ValueError as e:
        raise BadCursor(f"not a cursor this endpoint gave out: {cursor[:40]!r}") from e


async def episodes(
    principal: Principal,
    where: EpisodeFilter,
    *,
    limit: int,
    after: str | None,
    session: AsyncSession,
) -> dict[str, Any]:
    """One page of episodes, newest first, each with its calls' agents, versions and outcome;
    `next` is the cursor of the following page (None on the last)."""
    owns, owner = principal.owns_episode_sql("e.id")
    p: dict[str, Any] = dict(owner)
    conditions = [owns]
    if after is not None:
        p["after_at"], p["after_id"] = _parse_cursor(after)
        conditions.append("(e.created_at, e.id) < (:after_at, :after_id)")
    if where.search:
        p["search"] = principal.own(where.search)
        conditions.append("starts_with(e.id, :search)")
    for column, key, op in [
        ("e.task_id", "task", "="),
        ("e.final_reward", "min_reward", ">="),
        ("e.final_reward", "max_reward", "<="),
        ("e.created_at", "since", ">="),
        ("e.created_at", "until", "<"),
    ]:
        if getattr(where, key) is not None:
            p[key] = getattr(where, key)
            conditions.append(f"{column} {op} :{key}")
    ctes = []
    if where.agent is not None:
        p["agent"] = where.agent
        # Its calls counted from their index (migration 0015), up to RARE_AGENT_CALLS: none is
        # an empty page at once; a few (a rare agent, or one long gone) are listed first and
        # the page walks only their episodes; probing each episode walked read every episode
        # (or every call) for an agent that has none. A common agent's are everywhere: probed.
        owns_t, _ = principal.owns_episode_sql("t.episode_id")
        found = await session.scalar(
            text(
                "SELECT count(*) FROM (SELECT 1 FROM transition t WHERE t.agent_name = :agent "
                f"AND {owns_t} LIMIT :rare) AS x"
            ),
            p | {"rare": RARE_AGENT_CALLS},
        )
        if not found:
            return {"object": "list", "data": [], "next": None}
        if found < RARE_AGENT_CALLS:
            conditions.append("e.id IN (SELECT episode_id FROM of_agent)")
            ctes.append(
                "of_agent AS MATERIALIZED (SELECT DISTINCT t.episode_id FROM transition t "
                "WHERE t.agent_name = :agent)"
            )
        else:
            conditions.append(
                "EXISTS (SELECT 1 FROM transition t WHERE t.episode_id = e.id "
                "AND t.agent_name = :agent)"
            )
    if where.version is not None:
        # A version's episodes may lie deep in the list (an old one): its calls are read once
        # from their index instead, and the list walks only their episodes; probing every
        # day's partition for each episode walked took 16 s at a million calls.
        p["version"] = where.version
        conditions.append("e.id IN (SELECT episode_id FROM of_version)")
        ctes.append(
            "of_version AS MATERIALIZED (SELECT DISTINCT t.episode_id FROM transition t "
            "WHERE t.policy_version = :version)"
        )
    with_ = f"WITH {', '.join(ctes)}\n" if ctes else ""
    p["limit"] = limit + 1
    rows = (
        await session.execute(
            text(f"""{with_}
SELECT e.id, e.task_id, e.created_at, e.final_reward, s.calls, s.failed, s.agents, s.versions,
       s.tokens
FROM (  -- the page first: each episode's calls are summed for its rows only
    SELECT e.id, e.task_id, e.created_at, e.final_reward FROM episode e
    WHERE {" AND ".join(conditions)}
    ORDER BY e.created_at DESC, e.id DESC
    LIMIT :limit
) e
LEFT JOIN LATERAL (
    SELECT count(*) AS calls, count(*) FILTER (WHERE t.status <> 'ok') AS failed,
           array_agg(DISTINCT t.agent_name) FILTER (WHERE t.agent_name IS NOT NULL) AS agents,
           array_agg(DISTINCT t.policy_version) FILTER (WHERE t.policy_version IS NOT NULL)
               AS versions,
           sum(t.completion_tokens) AS tokens
    FROM transition t WHERE t.episode_id = e.id
) s ON TRUE
ORDER BY e.created_at DESC, e.id DESC"""),
            p,
        )
    ).all()
    page = rows[:limit]
    public = principal.public
    return {
        "object": "list",
        "data": [
            {
                "id": public(r.id),
                "task_id": public(r.task_id) if r.task_id else None,
                "created_at": r.created_at.isoformat(),
                "final_reward": r.final_reward,
                "calls": r.calls,
                "failed": r.failed,
                "agents": r.agents or [],
                "versions": r.versions or [],
                "completion_tokens": r.tokens,
            }
            for r in page
        ],
        "next": cursor_of(page[-1].created_at, page[-1].id) if len(rows) > limit else None,
    }


async def completion_tokens(
    principal: Principal, transition_id: str, *, session: AsyncSession
) -> tuple[bytes | None, bytes | None] | None:
    """A transition's packed completion ids and logprobs (None: no such transition for them)."""
    owns, p = principal.owns_episode_sql("t.episode_id")
    row = (
        await session.execute(
            text(
                "SELECT t.completion_token_ids, t.logprobs FROM transition t "
                f"WHERE t.id = CAST(:id AS uuid) AND {owns}"
            ),
            p | {"id": transition_id},
        )
    ).first()
    return None if row is None else (row[0], row[1])


def training_json(share: Share) -> dict[str, Any]:
    """The window's calls by fate, for the overview's "Training data" panel."""
    return {
        "calls": share.total,
        "trained": share.trained,
        "ratio": share.ratio,
        "awaiting_reward": share.calls.get("awaiting_reward", 0),
        "queued": share.calls.get("queued", 0),
        "not_trained": [
            {
                "fate": fate,
                "calls": n,
                "meaning": REASONS.get(fate, (fate, ""))[0],
                "fix": REASONS.get(fate, ("", ""))[1],
            }
            for fate, n in share.not_trained()
        ],
    }
