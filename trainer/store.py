"""All SQL of the trainer. Functions take `*, session` and never commit: the loop owns transactions.
(The adapter versions' SQL, which the proxy shares, is in core/policy.py.)

Claims are leases: `claimed_by` + `claim_expires_at`, taken with FOR UPDATE SKIP LOCKED, so two
trainers never take the same rows and a crashed trainer's rows come back when its lease runs out.
A batch becomes `trained_at` in the same transaction that records the adapter version trained on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from core import policy
from core.codecs import unpack


@dataclass(frozen=True)
class Claimed:
    id: str
    episode_id: str
    task_id: str | None
    agent_name: str | None
    policy_version: int | None
    ret: float
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    logprobs: list[float] | None
    params: dict[str, Any]


class LostClaim(Exception):
    """Our lease ran out and another trainer took (some of) the batch: discard this step."""


_CANDIDATES = """
SELECT id::text, episode_id, task_id, agent_name, policy_version, "return",
       prompt_token_ids, completion_token_ids, logprobs, params
FROM transition
WHERE status = 'ok' AND credited_at IS NOT NULL AND trained_at IS NULL AND skip_reason IS NULL
  AND (claim_expires_at IS NULL OR claim_expires_at < now())
  AND (CAST(:agents AS text[]) IS NULL OR agent_name = ANY(CAST(:agents AS text[])))
ORDER BY credited_at
LIMIT :limit
FOR UPDATE SKIP LOCKED
"""


def claim(
    *,
    session: Session,
    trainer_id: str,
    lease_s: float,
    agents: list[str],
    limit: int,
    min_episodes: int,
    min_groups: int,
) -> list[Claimed]:
    """Claim the oldest credited, untrained transitions if they make a big enough batch.

    Too few: nothing is written (the row locks go with the transaction).
    """
    rows = session.execute(text(_CANDIDATES), {"agents": agents or None, "limit": limit}).all()
    claimed = [
        Claimed(
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            r[5],
            unpack(r[6], "i"),
            unpack(r[7], "i"),
            unpack(r[8], "f"),
            r[9] or {},
        )
        for r in rows
    ]
    episodes_by_task: dict[str, set[str]] = {}
    for c in claimed:
        if c.task_id is not None:
            episodes_by_task.setdefault(c.task_id, set()).add(c.episode_id)
    groups = sum(1 for episodes in episodes_by_task.values() if len(episodes) >= 2)
    if len({c.episode_id for c in claimed}) < min_episodes or groups < min_groups:
        return []
    session.execute(
        text(
            "UPDATE transition SET claimed_by = :me, "
            "claim_expires_at = now() + make_interval(secs => :lease) "
            "WHERE id = ANY(CAST(:ids AS uuid[]))"
        ),
        {"me": trainer_id, "lease": lease_s, "ids": [c.id for c in claimed]},
    )
    return claimed


def finish(
    *,
    session: Session,
    trainer_id: str,
    trained: list[str],
    skipped: dict[str, str],
    version: int,
    name: str,
    path: str,
    base_model: str,
    stats: dict[str, Any],
) -> None:
    """Make `version` current and mark its batch trained (and the set-aside rows skipped)."""
    done = session.execute(
        text(
            "UPDATE transition SET trained_at = now(), trained_version = :v, claimed_by = NULL, "
            "claim_expires_at = NULL WHERE id = ANY(CAST(:ids AS uuid[])) AND claimed_by = :me "
            "AND trained_at IS NULL RETURNING id"
        ),
        {"ids": trained, "me": trainer_id, "v": version},
    ).all()
    if len(done) != len(trained):
        raise LostClaim(f"{len(trained) - len(done)} of {len(trained)} rows were taken over")
    set_aside(skipped, session=session, trainer_id=trainer_id)
    policy.publish(
        session=session,
        version=version,
        name=name,
        path=path,
        base_model=base_model,
        stats=stats,
        trained_transitions=len(trained),
    )


def set_aside(skipped: dict[str, str], *, session: Session, trainer_id: str) -> None:
    """Record why these claimed rows will never be trained; they leave the queue."""
    for reason in sorted(set(skipped.values())):
        session.execute(
            text(
                "UPDATE transition SET skip_reason = :reason, claimed_by = NULL, "
                "claim_expires_at = NULL WHERE id = ANY(CAST(:ids AS uuid[])) AND claimed_by = :me"
            ),
            {
                "reason": reason,
                "ids": [i for i, r in skipped.items() if r == reason],
                "me": trainer_id,
            },
        )


def release(ids: list[str], *, session: Session, trainer_id: str) -> None:
    """Give a batch back (the step failed): the next claim may take it at once."""
    session.execute(
        text(
            "UPDATE transition SET claimed_by = NULL, claim_expires_at = NULL "
            "WHERE id = ANY(CAST(:ids AS uuid[])) AND claimed_by = :me"
        ),
        {"ids": ids, "me": trainer_id},
    )


def queue_depth(*, session: Session, agents: list[str]) -> int:
    """Credited, untrained, trainable transitions waiting (claimed or not)."""
    return int(
        session.execute(
            text(
                "SELECT count(*) FROM transition WHERE status = 'ok' AND credited_at IS NOT NULL "
                "AND trained_at IS NULL AND skip_reason IS NULL AND (CAST(:agents AS text[]) IS "
                "NULL OR agent_name = ANY(CAST(:agents AS text[])))"
            ),
            {"agents": agents or None},
        ).scalar_one()
    )
