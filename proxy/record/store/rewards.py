"""Rewards and credit: rewards as posted (all or nothing, idempotent by key), step rewards that
wait for their transition, AIR's own, and the returns credit assignment derives from them
(proxy/record/credit.py computes; this stores).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ARRAY, Text, Uuid, any_, bindparam, func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from core.record import TransitionRecord
from core.tables import Episode, Reward, Transition
from proxy.record.credit import Step, assign_returns
from proxy.record.schemas import RewardIn
from proxy.record.store.episodes import lock_episodes

# --- rewards ---------------------------------------------------------------------------------


class RewardConflict(Exception):
    """The reward would change a return that training has already used."""


class UnknownTransition(Exception):
    pass


class AmbiguousToolCall(Exception):
    """A tool call id that several transitions of one episode share (n > 1 with fixed ids)."""


class KeyReused(Exception):
    """An idempotency key already stored for this episode with another value."""


@dataclass(frozen=True)
class Stored:
    status: str  # "accepted", "duplicate" or "pending"
    transition_id: uuid.UUID | None  # the step it went to
    credited: int  # transitions of its episode credited now


async def add_rewards(
    rewards: list[RewardIn],
    *,
    session: AsyncSession,
    gamma: float | None,
    posted_at: Sequence[float] | None = None,
) -> list[Stored]:
    """Record rewards and re-credit their episodes, in a few statements however many there are
    (a post may hold 10,000). All or nothing: raises UnknownTransition, AmbiguousToolCall,
    KeyReused or RewardConflict, and the caller's transaction then stores none of them.

    An idempotency key is unique per episode: its repeat with the same value is a "duplicate",
    with another value KeyReused. A step reward for a transition (or tool call) not stored yet is
    "pending": kept, and joined to it when the writer stores it (`attach_pending_rewards`), as a
    final reward for an episode not seen yet is. Posts for one episode are serialised by the
    episode row lock; the unique constraint backs it up.

    `posted_at` (unix seconds, one per reward; default now): when each was posted. The last
    *posted* final reward is the episode's, not the last applied: a reward journaled while one
    proxy was cut off, replayed after a newer one was stored through another, is kept in the
    history but does not replace it (`episode.final_reward_at` is when the current one was
    posted, by the posting proxy's clock).
    """
    now = time.time()
    posted = list(posted_at) if posted_at is not None else [now] * len(rewards)
    await lock_episodes(dict.fromkeys(r.episode_id for r in rewards), session=session)
    seen = await _stored_keys(rewards, session=session)
    owners = await _owners([r.transition_id for r in rewards if r.transition_id], session=session)
    out: list[tuple[str, uuid.UUID | None]] = []
    rows: list[dict[str, Any]] = []
    finals: dict[str, tuple[float, float]] = {}  # episode -> (value, posted at)
    for r, at in zip(rewards, posted, strict=True):
        if r.idempotency_key is not None and (r.episode_id, r.idempotency_key) in seen:
            value = seen[r.episode_id, r.idempotency_key]
            if value != r.reward:
                raise KeyReused(
                    f"idempotency_key {r.idempotency_key!r} was used in episode "
                    f"{r.episode_id!r} for another reward ({value}); use a new key for a new reward"
                )
            out.append(("duplicate", None))
            continue
        row: dict[str, Any] = {
            "episode_id": r.episode_id,
            "value": r.reward,
            "source": r.source,
            "idempotency_key": r.idempotency_key,
            "transition_id": None,
            "pending_transition_id": None,
            "pending_tool_call_id": None,
        }
        status, target = "accepted", r.transition_id
        if r.tool_call_id is not None:
            try:
                target = await transition_of_tool_call(
                    r.episode_id, r.tool_call_id, session=session
                )
            except UnknownTransition:
                status, row["pending_tool_call_id"] = "pending", r.tool_call_id
        elif target is not None:
            owner = owners.get(target)
            if owner is None:
                status, row["pending_transition_id"], target = "pending", target, None
            elif owner != r.episode_id:
                raise UnknownTransition(f"no transition {target} in episode {r.episode_id!r}")
        elif r.episode_id not in finals or finals[r.episode_id][1] <= at:
            finals[r.episode_id] = (r.reward, at)  # the last posted of several wins
        row["transition_id"] = target if status == "accepted" else None
        rows.append(row)
        out.append((status, row["transition_id"]))

    if finals:
        await session.execute(
            text(
                "UPDATE episode AS e SET final_reward = u.v, final_reward_at = to_timestamp(u.at) "
                "FROM unnest(CAST(:ids AS text[]), CAST(:vs AS float8[]), CAST(:ats AS float8[])) "
                "AS u(id, v, at) "
                "WHERE e.id = u.id "
                "AND (e.final_reward_at IS NULL OR e.final_reward_at <= to_timestamp(u.at))"
            ),
            {
                "ids": list(finals),
                "vs": [v for v, _ in finals.values()],
                "ats": [at for _, at in finals.values()],
            },
        )
    if rows:  # ON CONFLICT: only if the episode lock were bypassed (the key is stored then)
        await session.execute(
            insert(Reward).on_conflict_do_nothing(index_elements=["episode_id", "idempotency_key"]),
            rows,
        )
    touched = sorted(
        {r.episode_id for r, (status, _) in zip(rewards, out, strict=True) if status == "accepted"}
    )
    credited = await credit_episodes(touched, session=session, gamma=gamma, strict=True)
    return [
        Stored(status, tid, credited.get(r.episode_id, 0) if status == "accepted" else 0)
        for r, (status, tid) in zip(rewards, out, strict=True)
    ]


async def _stored_keys(
    rewards: list[RewardIn], *, session: AsyncSession
) -> dict[tuple[str, str], float]:
    """(episode, idempotency key) -> value of those already stored."""
    keyed = [(r.episode_id, r.idempotency_key) for r in rewards if r.idempotency_key]
    if not keyed:
        return {}
    rows = await session.execute(
        text(
            "SELECT r.episode_id, r.idempotency_key, r.value FROM reward AS r "
            "JOIN unnest(CAST(:eps AS text[]), CAST(:keys AS text[])) AS u(e, k) "
            "ON r.episode_id = u.e AND r.idempotency_key = u.k"
        ),
        {"eps": [e for e, _ in keyed], "keys": [k for _, k in keyed]},
    )
    return {(e, k): v for e, k, v in rows}


async def _owners(ids: list[uuid.UUID], *, session: AsyncSession) -> dict[uuid.UUID, str]:
    """The episode of each of these transitions that is stored."""
    if not ids:
        return {}
    rows = await session.execute(
        select(Transition.id, Transition.episode_id).where(
            Transition.id == any_(bindparam("ids", ids, ARRAY(Uuid)))
        )
    )
    return dict(rows.tuples().all())


async def attach_pending_rewards(records: list[TransitionRecord], *, session: AsyncSession) -> None:
    """Step rewards that arrived before these transitions were stored now name them (by id, or
    by a tool call they made). Runs after the episode rows are locked: a reward transaction that
    saw no transition either committed its pending row before, or sees the transitions after."""
    calls = [
        (r.episode_id, str(c["id"]), r.id)
        for r in records
        for c in r.tool_calls or ()
        if isinstance(c, dict) and c.get("id")
    ]
    await session.execute(
        text(
            "UPDATE reward AS r SET transition_id = u.t, pending_transition_id = NULL, "
            "pending_tool_call_id = NULL "
            "FROM unnest(CAST(:episodes AS text[]), CAST(:calls AS text[]), CAST(:ids AS uuid[])) "
            "AS u(e, call, t) "
            "WHERE (r.pending_transition_id IS NOT NULL OR r.pending_tool_call_id IS NOT NULL) "
            "AND r.episode_id = u.e "
            "AND (r.pending_transition_id = u.t OR r.pending_tool_call_id = u.call)"
        ),
        {
            "episodes": [r.episode_id for r in records] + [e for e, _, _ in calls],
            "calls": [None] * len(records) + [c for _, c, _ in calls],
            "ids": [r.id for r in records] + [t for _, _, t in calls],
        },
    )


async def transition_of_tool_call(
    episode_id: str, tool_call_id: str, *, session: AsyncSession
) -> uuid.UUID:
    """The transition of this episode whose completion made the tool call `tool_call_id` (the id
    a framework sends back with the tool's result: chat `tool_call_id`, Responses `call_id`)."""
    found = (
        await session.scalars(
            select(Transition.id)
            .where(
                Transition.episode_id == episode_id,
                Transition.tool_calls.contains([{"id": tool_call_id}]),
            )
            .limit(2)
        )
    ).all()
    if not found:
        raise UnknownTransition(f"no tool call {tool_call_id!r} in episode {episode_id!r}")
    if len(found) > 1:
        raise AmbiguousToolCall(
            f"tool call id {tool_call_id!r} appears in several transitions of episode "
            f"{episode_id!r}; name the transition_id"
        )
    return found[0]


async def add_air_rewards(
    records: list[TransitionRecord], value: float, *, session: AsyncSession
) -> None:
    """One `air` reward per record, keyed by its transition (a replayed record adds none)."""
    if not records:
        return
    await session.execute(
        text(
            "INSERT INTO reward (episode_id, transition_id, value, source, idempotency_key) "
            "SELECT e, t, :value, 'air', 'air:' || t "
            "FROM unnest(CAST(:episodes AS text[]), CAST(:transitions AS uuid[])) AS u(e, t) "
            "ON CONFLICT (episode_id, idempotency_key) DO NOTHING"
        ),
        {
            "value": value,
            "episodes": [r.episode_id for r in records],
            "transitions": [r.id for r in records],
        },
    )


# --- credit ----------------------------------------------------------------------------------


async def credit_episodes(
    episode_ids: list[str], *, session: AsyncSession, gamma: float | None, strict: bool = False
) -> dict[str, int]:
    """(Re)compute the return of every untrained transition of these episodes that have a final
    reward. Returns how many transitions each episode has credited.

    strict (a posted reward): refuse with RewardConflict, changing nothing, if the return of a
    trained transition would change. The rows are locked first, so a trainer's `finish` either
    committed before (and this sees them trained) or waits for this commit. A claimed, untrained
    transition's return may change either way: `finish` checks the returns it trained on are
    still the stored ones, and otherwise gives the batch back to be trained with the new ones.
    """
    if not episode_ids:
        return {}
    step_reward = (
        select(func.coalesce(func.sum(Reward.value), 0.0))
        .where(Reward.transition_id == Transition.id)
        .scalar_subquery()
    )
    query = (
        select(
            Transition.episode_id,
            Transition.id,
            Transition.request_id,
            Transition.requested_at,
            step_reward,
            Episode.final_reward,
            Transition.return_,
            Transition.trained_at,
        )
        .join(Episode, Episode.id == Transition.episode_id)
        .where(
            Transition.episode_id == any_(bindparam("episode_ids", episode_ids, ARRAY(Text))),
            Episode.final_reward.is_not(None),
        )
    )
    if strict:
        query = query.with_for_update(of=Transition)
    by_episode: dict[str, tuple[float, list[Step]]] = {}
    # Trained transitions' returns may no longer change: (episode, return) of each.
    trained: dict[uuid.UUID, tuple[str, float | None]] = {}
    for episode_id, tid, rid, at, r_step, final, ret, trained_at in await session.execute(query):
        by_episode.setdefault(episode_id, (final, []))[1].append(Step(tid, rid, at, r_step))
        if trained_at is not None:
            trained[tid] = (episode_id, ret)
    returns: dict[uuid.UUID, float] = {}
    for final, steps in by_episode.values():
        returns.update(assign_returns(steps, final, gamma))
    changed = sorted({e for tid, (e, ret) in trained.items() if returns.get(tid) != ret})
    if strict and changed:
        raise RewardConflict(
            f"episode {changed[0]!r}{f' (and {len(changed) - 1} more)' if changed[1:] else ''} "
            "was already trained on with its returns; a reward that changes them is refused"
        )
    if not returns:
        return {}
    await session.execute(
        text(
            'UPDATE transition AS t SET "return" = u.ret, credited_at = now() '
            "FROM unnest(CAST(:ids AS uuid[]), CAST(:rets AS float8[])) AS u(id, ret) "
            "WHERE t.id = u.id AND t.trained_at IS NULL"
        ),
        {"ids": list(returns), "rets": list(returns.values())},
    )
    return {episode_id: len(steps) for episode_id, (_, steps) in by_episode.items()}
