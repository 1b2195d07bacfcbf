"""The trainer's claims on recorded calls, and the publish that marks them trained. Functions take
`*, session` and never commit: the loop owns transactions. (Demonstrations' SQL is in
demonstrations.py, the logged window a candidate is estimated on in logged.py; the adapter
versions', which the proxy shares, in core/policy.py.)

Claims are leases: `claimed_by` + `claim_expires_at`, taken with FOR UPDATE SKIP LOCKED, so two
trainers never take the same rows and a crashed trainer's rows come back when its lease runs out.
A batch becomes `trained_at` in the same transaction that records the adapter version trained on it,
and only if every return it trained on is still the stored one (a reward may have moved it).
Every claim counts an attempt (a trainer that crashes mid-step has used it), given back when the
step failed for a reason not the batch's (trainer/faults.py: an outage, a lost race); a row
whose batch failed the step `max_attempts` times is set aside as `train_failed` instead of
stalling the queue.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any, Literal

from sqlalchemy import text
from sqlalchemy.orm import Session

from core import canary, policy
from core.codecs import unpack
from core.tables import PROMPT_IDS_SQL, TRAINABLE
from core.tenants import TENANT_OF_EPISODE


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
    params: dict[str, Any]  # the request minus its prompt: how it was sampled
    made_tool_call: bool
    age_s: float  # since the call was made, by the database's clock
    route: str = "chat"  # the API it came through: a Messages call's params are Anthropic's


Table = Literal["transition", "demonstration"]  # what a claim is on


class LostClaim(Exception):
    """Our lease ran out and another trainer took (some of) the batch, or a reward changed a
    return we trained on: discard this step."""


@dataclass(frozen=True)
class Publication:
    """The version a step publishes, as `policy.publish` records it: made current, or the
    lineage's canary candidate (`canary_rule`), or recorded rejected by the gate (`rejected`).
    `parent` is the version the step started from (None: the base model)."""

    lineage: str
    version: int
    parent: int | None
    path: str
    base_model: str
    stats: dict[str, Any]
    canary_rule: canary.Rule | None = None
    rejected: bool = False

    def publish(self, *, session: Session, trained_transitions: int) -> None:
        policy.publish(
            session=session,
            trained_transitions=trained_transitions,
            **{f.name: getattr(self, f.name) for f in fields(self)},
        )


# Credited, untrained, trainable, served by this trainer's lineage, and of the agents and tenants
# it trains (if limited).
_QUEUED = f"""
{TRAINABLE}
  AND lineage = :lineage
  AND (CAST(:agents AS text[]) IS NULL OR agent_name = ANY(CAST(:agents AS text[])))
  AND (CAST(:tenants AS text[]) IS NULL OR {TENANT_OF_EPISODE} = ANY(CAST(:tenants AS text[])))
"""

_CANDIDATES = f"""
SELECT id::text AS id, episode_id, task_id, agent_name, policy_version, "return" AS ret,
       {PROMPT_IDS_SQL.format(row="transition")} AS prompt_token_ids, completion_token_ids,
       logprobs, params, train_attempts,
       (jsonb_typeof(tool_calls) = 'array' AND jsonb_array_length(tool_calls) > 0)
           IS TRUE AS made_tool_call,
       extract(epoch FROM now() - requested_at) AS age_s, route
FROM transition
WHERE {_QUEUED} AND (claim_expires_at IS NULL OR claim_expires_at < now())
ORDER BY credited_at
LIMIT :limit
FOR UPDATE SKIP LOCKED
"""


def claim(
    *,
    session: Session,
    trainer_id: str,
    lease_s: float,
    lineage: str,
    agents: list[str],
    tenants: list[str],
    limit: int,
    min_episodes: int,
    min_groups: int,
    max_attempts: int,
    holdout: float = 0.0,
) -> list[Claimed]:
    """Claim the oldest credited, untrained transitions if they make a big enough batch.

    Too few: nothing is claimed (the row locks go with the transaction); rows that have used up
    their attempts, and those of the `holdout` share of episodes (`held_out`), are set aside
    all the same.
    """
    rows = (
        session.execute(
            text(_CANDIDATES),
            {
                "lineage": lineage,
                "agents": agents or None,
                "tenants": tenants or None,
                "limit": limit,
            },
        )
        .mappings()
        .all()
    )
    aside = {r["id"]: "ope_holdout" for r in rows if held_out(r["episode_id"], holdout)}
    aside |= {
        r["id"]: "train_failed"
        for r in rows
        if r["train_attempts"] >= max_attempts and r["id"] not in aside
    }
    if aside:  # locked by this transaction; any claim on them has expired (a crashed trainer's)
        session.execute(
            text(
                "UPDATE transition AS t SET skip_reason = u.reason, claimed_by = NULL, "
                "claim_expires_at = NULL "
                "FROM unnest(CAST(:ids AS uuid[]), CAST(:reasons AS text[])) AS u(id, reason) "
                "WHERE t.id = u.id"
            ),
            {"ids": list(aside), "reasons": list(aside.values())},
        )
        rows = [r for r in rows if r["id"] not in aside]
    claimed = [
        Claimed(
            id=r["id"],
            episode_id=r["episode_id"],
            task_id=r["task_id"],
            agent_name=r["agent_name"],
            policy_version=r["policy_version"],
            ret=r["ret"],
            prompt_token_ids=unpack(r["prompt_token_ids"], "i"),
            completion_token_ids=unpack(r["completion_token_ids"], "i"),
            logprobs=unpack(r["logprobs"], "f"),
            params=r["params"] or {},
            made_tool_call=r["made_tool_call"],
            age_s=float(r["age_s"]),
            route=r["route"],
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
            "UPDATE transition SET claimed_by = :me, train_attempts = train_attempts + 1, "
            "claim_expires_at = now() + make_interval(secs => :lease) "
            "WHERE id = ANY(CAST(:ids AS uuid[]))"
        ),
        {"me": trainer_id, "lease": lease_s, "ids": [c.id for c in claimed]},
    )
    return claimed


def held_out(episode_id: str, share: float) -> bool:
    """Whether an episode is in the `share` kept out of training to estimate new versions on
    (FLYWHEEL_OPE_HOLDOUT): a hash of its id, the same on every trainer and every run."""
    if share <= 0:
        return False
    digest = hashlib.blake2b(episode_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


def finish(
    *,
    session: Session,
    trainer_id: str,
    trained: dict[str, float],
    skipped: dict[str, str],
    publication: Publication,
) -> None:
    """Publish the step's version (`Publication`: current, the lineage's canary candidate or
    rejected by the gate) and mark its batch trained (and the set-aside rows skipped).

    `trained` maps each row to the return it was trained on: a row claimed by someone else now,
    or whose return a reward has changed since, is LostClaim. `parent` is the version the step
    started from: if another is current now, policy.PolicyMoved (see `policy.publish`).
    """
    done = session.execute(
        text(
            "UPDATE transition AS t SET trained_at = now(), trained_version = :v, "
            "claimed_by = NULL, claim_expires_at = NULL "
            "FROM unnest(CAST(:ids AS uuid[]), CAST(:rets AS float8[])) AS u(id, ret) "
            "WHERE t.id = u.id AND t.claimed_by = :me AND t.trained_at IS NULL "
            'AND t."return" = u.ret '
            "RETURNING t.id"
        ),
        {
            "ids": list(trained),
            "rets": list(trained.values()),
            "me": trainer_id,
            "v": publication.version,
        },
    ).all()
    if len(done) != len(trained):
        raise LostClaim(
            f"{len(trained) - len(done)} of {len(trained)} rows were taken over or had their "
            "return changed by a reward"
        )
    set_aside(skipped, session=session, trainer_id=trainer_id)
    publication.publish(session=session, trained_transitions=len(trained))


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


def release(
    ids: list[str],
    *,
    session: Session,
    trainer_id: str,
    attempt: bool = True,
    table: Table = "transition",
) -> None:
    """Give a batch back (the step failed): the next claim may take it at once. `attempt`:
    the claim counts as one of its train attempts (it was counted when claimed); False when
    the failure was not the batch's."""
    uncount = "" if attempt else ", train_attempts = greatest(train_attempts - 1, 0)"
    session.execute(
        text(
            f"UPDATE {table} SET claimed_by = NULL, claim_expires_at = NULL{uncount} "
            "WHERE id = ANY(CAST(:ids AS uuid[])) AND claimed_by = :me"
        ),
        {"ids": ids, "me": trainer_id},
    )


def release_all(*, session: Session, trainer_id: str) -> int:
    """Give back everything we hold, at shutdown; that claim does not count as an attempt."""
    released = 0
    for table, untrained in (("transition", " AND trained_at IS NULL"), ("demonstration", "")):
        released += len(
            session.execute(
                text(
                    f"UPDATE {table} SET claimed_by = NULL, claim_expires_at = NULL, "
                    "train_attempts = greatest(train_attempts - 1, 0) "
                    f"WHERE claimed_by = :me{untrained} RETURNING id"
                ),
                {"me": trainer_id},
            ).all()
        )
    return released


def queue_depth(*, session: Session, lineage: str, agents: list[str], tenants: list[str]) -> int:
    """Credited, untrained, trainable transitions waiting (claimed or not)."""
    return int(
        session.execute(
            text(f"SELECT count(*) FROM transition WHERE {_QUEUED}"),
            {"lineage": lineage, "agents": agents or None, "tenants": tenants or None},
        ).scalar_one()
    )
