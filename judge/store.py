"""All SQL of the judge: which episodes are due, claiming them, their calls, and the record of
each judgement (`judgement`, migration 0012). Functions take `session`, never commit.

An episode is due when it has no final reward, its last call is older than the grace period,
it is the judge's tenant's (and of a task it judges), and it has no judgement yet, or only a
claim that expired or an attempt that failed and may be tried again. A claim is a `judgement`
row in state `claimed` with a lease, so several judges share the work and a judge that dies
leaves nothing stuck.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from core.export_kinds import MESSAGES_SQL
from core.ruler import Call
from core.tenants import Principal


@dataclass(frozen=True)
class Due:
    episode_id: str  # stored
    task_id: str | None  # stored
    last_call_at: datetime


_DUE = """
SELECT e.id, e.task_id, e.last_call_at FROM episode e
LEFT JOIN judgement j ON j.episode_id = e.id
WHERE e.final_reward IS NULL AND e.last_call_at < now() - make_interval(secs => :grace)
  AND {owns}
  AND (j.episode_id IS NULL
       OR (j.status = 'claimed' AND j.claimed_until < now())
       OR (j.status = 'failed' AND j.attempts < :attempts))
ORDER BY e.last_call_at
LIMIT :limit
FOR UPDATE OF e SKIP LOCKED"""


def due(
    principal: Principal, *, grace_s: float, attempts: int, limit: int, session: Session
) -> list[Due]:
    """The oldest due episodes, row-locked until the caller's transaction ends."""
    owns, params = principal.owns_episode_sql("e.id")
    rows = session.execute(
        text(_DUE.format(owns=owns)),
        {"grace": grace_s, "attempts": attempts, "limit": limit, **params},
    )
    return [Due(*row) for row in rows]


def claim(ids: list[str], *, judge: str, lease_s: float, session: Session) -> None:
    session.execute(
        text("""
INSERT INTO judgement (episode_id, status, claimed_by, claimed_until, attempts)
SELECT id, 'claimed', :judge, now() + make_interval(secs => :lease), 1
FROM unnest(CAST(:ids AS text[])) AS id
ON CONFLICT (episode_id) DO UPDATE SET status = 'claimed', claimed_by = :judge,
    claimed_until = excluded.claimed_until, attempts = judgement.attempts + 1"""),
        {"ids": ids, "judge": judge, "lease": lease_s},
    )


def calls(ids: list[str], *, session: Session) -> dict[str, list[Call]]:
    """Each episode's successful calls in order, with their prompt messages."""
    rows = session.execute(
        text(f"""
SELECT t.episode_id, t.agent_name, msg.messages, t.text, t.tool_calls
FROM transition t
{MESSAGES_SQL.format(row="t")} ON TRUE
WHERE t.episode_id = ANY(CAST(:ids AS text[])) AND t.status = 'ok'
ORDER BY t.episode_id, t.requested_at, t.choice_index"""),
        {"ids": ids},
    )
    out: dict[str, list[Call]] = {i: [] for i in ids}
    for episode_id, agent, messages, answer, tool_calls in rows:
        out[episode_id].append(Call(agent, messages or [], answer, tool_calls))
    return out


def still_unrewarded(ids: list[str], *, session: Session) -> set[str]:
    """Those that still have no final reward (the application may have posted one meanwhile)."""
    rows = session.execute(
        text(
            "SELECT id FROM episode WHERE id = ANY(CAST(:ids AS text[])) AND final_reward IS NULL"
        ),
        {"ids": ids},
    )
    return {row[0] for row in rows}


@dataclass(frozen=True)
class Verdict:
    episode_id: str
    score: float | None  # None: not posted (a reward came meanwhile)
    rationale: str


def judged(
    verdicts: list[Verdict],
    *,
    model: str,
    usage: dict[str, Any],
    cost_usd: float | None,
    session: Session,
) -> None:
    """Record a group's judgement: each episode's score and rationale, and the call's tokens and
    cost (the group's; every row of the group carries the same `group_id`)."""
    session.execute(
        text("""
UPDATE judgement j SET status = CASE WHEN v.score IS NULL THEN 'skipped' ELSE 'judged' END,
    score = v.score, rationale = v.rationale, model = :model, group_id = :group,
    group_size = :size, prompt_tokens = :prompt_tokens, completion_tokens = :completion_tokens,
    cost_usd = :cost, judged_at = now(), error = NULL, claimed_until = NULL
FROM unnest(CAST(:ids AS text[]), CAST(:scores AS float8[]), CAST(:rationales AS text[]))
    AS v(episode_id, score, rationale)
WHERE j.episode_id = v.episode_id"""),
        {
            "ids": [v.episode_id for v in verdicts],
            "scores": [v.score for v in verdicts],
            "rationales": [v.rationale for v in verdicts],
            "model": model,
            "group": uuid.uuid4(),
            "size": len(verdicts),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cost": cost_usd,
        },
    )


def failed(ids: list[str], error: str, *, session: Session) -> None:
    session.execute(
        text(
            "UPDATE judgement SET status = 'failed', error = :error, claimed_until = NULL "
            "WHERE episode_id = ANY(CAST(:ids AS text[]))"
        ),
        {"ids": ids, "error": error[:2000]},
    )
