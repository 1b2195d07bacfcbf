"""All SQL of the proxy. Functions take `*, session` and never commit: callers own transactions.
(The adapter versions' SQL, which the trainer shares, is in core/policy.py.)

Lock order, to make writer and reward transactions see each other: both first upsert the episode
rows they touch (which row-locks them, in sorted id order), then read or write transitions. Whoever
commits second sees the first one's rows, so a reward and its transitions always meet.
"""

from __future__ import annotations

import uuid
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ARRAY, Text, any_, bindparam, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from core.codecs import PackedDigests, message_digest, pack, pack_digests
from core.pgcopy import copy_insert
from core.record import TRANSITION_COLUMNS, TransitionRecord, copy_row
from core.tables import Episode, Message, Reward, Transition
from proxy.credit import Step, assign_returns

# --- recording (the background writer) -------------------------------------------------------


async def lock_episodes(episodes: dict[str, str | None], *, session: AsyncSession) -> None:
    """Create missing episode rows and row-lock all of them, in id order (no deadlocks)."""
    if not episodes:
        return
    ids = sorted(episodes)
    # Two array parameters, not a VALUES row per episode: a batch of interleaved episodes has
    # hundreds, and building that statement cost the writer more than packing their token ids.
    await session.execute(
        text(
            "INSERT INTO episode (id, task_id) "
            "SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:task_ids AS text[])) "
            "ON CONFLICT (id) DO UPDATE SET task_id = coalesce(episode.task_id, excluded.task_id)"
        ),
        {"ids": ids, "task_ids": [episodes[i] for i in ids]},
    )


MESSAGE_COLUMNS = (("digest", "bytea"), ("body", "jsonb"))


async def insert_transitions(
    records: list[TransitionRecord],
    *,
    session: AsyncSession,
    gamma: float | None,
    air_penalty: float | None = None,
    stored_messages: Container[bytes] = frozenset(),
) -> list[bytes]:
    """Write recorded transitions (idempotent by id: journal replays may repeat some), with an
    `air` reward of -air_penalty for each one whose tool calls AIR found wrong (proxy/air.py).

    Messages whose digest is in `stored_messages` (known to be committed already) are not sent
    again. Returns the digests of the messages it sent: stored once the caller commits.
    """
    episodes: dict[str, str | None] = {}
    for r in records:
        episodes[r.episode_id] = episodes.get(r.episode_id) or r.task_id
    await lock_episodes(episodes, session=session)

    messages: dict[bytes, Any] = {}
    # The n choices of one request share one prompt list and (chat) one list of prompt token
    # ids: hash and pack those once (the records hold the lists alive, so ids stay unique here).
    packed_by_prompt: dict[int, PackedDigests] = {}
    packed_prompt_ids: dict[int, bytes | None] = {}
    rows = []
    for r in records:
        prompt = r.messages
        packed = packed_by_prompt.get(id(prompt))
        if packed is None:
            digests = []
            for body in prompt:
                digest = message_digest(body)
                if digest not in stored_messages:
                    messages[digest] = body
                digests.append(digest)
            packed = packed_by_prompt[id(prompt)] = pack_digests(digests)
        prompt_ids = r.prompt_token_ids
        if id(prompt_ids) not in packed_prompt_ids:
            packed_prompt_ids[id(prompt_ids)] = pack(prompt_ids, "i")
        rows.append(copy_row(r, packed, packed_prompt_ids[id(prompt_ids)]))
    if messages:
        # In digest order: two writers inserting the same new messages never deadlock.
        await copy_insert(session, "message", MESSAGE_COLUMNS, sorted(messages.items()))
    await copy_insert(session, "transition", TRANSITION_COLUMNS, rows)
    if air_penalty is not None:
        await add_air_rewards([r for r in records if r.tool_errors], -air_penalty, session=session)
    await attach_pending_rewards(records, session=session)
    await credit_episodes(sorted(episodes), session=session, gamma=gamma)
    return list(messages)


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
) -> int:
    """(Re)compute the return of every untrained transition of these episodes that have a final
    reward. Returns how many transitions were credited.

    strict (a posted reward): refuse with RewardConflict, changing nothing, if the return of a
    trained transition would change. The rows are locked first, so a trainer's `finish` either
    committed before (and this sees them trained) or waits for this commit. A claimed, untrained
    transition's return may change either way: `finish` checks the returns it trained on are
    still the stored ones, and otherwise gives the batch back to be trained with the new ones.
    """
    if not episode_ids:
        return 0
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
    trained: dict[uuid.UUID, float | None] = {}  # their returns, which may no longer change
    for episode_id, tid, rid, at, r_step, final, ret, trained_at in await session.execute(query):
        by_episode.setdefault(episode_id, (final, []))[1].append(Step(tid, rid, at, r_step))
        if trained_at is not None:
            trained[tid] = ret
    returns: dict[uuid.UUID, float] = {}
    for final, steps in by_episode.values():
        returns.update(assign_returns(steps, final, gamma))
    if strict and any(returns.get(tid) != ret for tid, ret in trained.items()):
        raise RewardConflict(
            f"{len(trained)} transition(s) of episode(s) {', '.join(sorted(by_episode))} were "
            "already trained on with their returns; a reward that changes them is refused"
        )
    if not returns:
        return 0
    await session.execute(
        text(
            'UPDATE transition AS t SET "return" = u.ret, credited_at = now() '
            "FROM unnest(CAST(:ids AS uuid[]), CAST(:rets AS float8[])) AS u(id, ret) "
            "WHERE t.id = u.id AND t.trained_at IS NULL"
        ),
        {"ids": list(returns), "rets": list(returns.values())},
    )
    return len(returns)


# --- rewards ---------------------------------------------------------------------------------


class RewardConflict(Exception):
    """The reward would change a return that training has already used."""


class UnknownTransition(Exception):
    pass


class AmbiguousToolCall(Exception):
    """A tool call id that several transitions of one episode share (n > 1 with fixed ids)."""


class KeyReused(Exception):
    """An idempotency key already stored for this episode with another value or transition."""


async def add_reward(
    *,
    session: AsyncSession,
    episode_id: str,
    value: float,
    transition_id: uuid.UUID | None = None,
    tool_call_id: str | None = None,
    idempotency_key: str | None,
    gamma: float | None,
    source: str | None = None,
) -> tuple[str, uuid.UUID | None, int]:
    """Record one reward and re-credit its episode.

    Returns (status, the transition it went to, transitions credited); status is "accepted",
    "duplicate" (its idempotency key was seen: unique per episode, so it must be the same
    reward, else KeyReused) or "pending": a step reward for a transition (or tool call) not
    stored yet, kept until the writer stores it (`attach_pending_rewards`), like a final reward
    for an episode not seen yet. Posts for one episode are serialised by the episode row lock.
    """
    await lock_episodes({episode_id: None}, session=session)
    if idempotency_key is not None:
        seen = await session.scalar(
            select(Reward).where(
                Reward.episode_id == episode_id, Reward.idempotency_key == idempotency_key
            )
        )
        if seen is not None:
            if seen.value != value:
                raise KeyReused(
                    f"idempotency_key {idempotency_key!r} was used in episode {episode_id!r} "
                    f"for another reward ({seen.value}); use a new key for a new reward"
                )
            return "duplicate", seen.transition_id, 0

    pending: dict[str, Any] = {}
    if tool_call_id is not None:
        try:
            transition_id = await transition_of_tool_call(episode_id, tool_call_id, session=session)
        except UnknownTransition:
            pending = {"pending_tool_call_id": tool_call_id}
    elif transition_id is not None:
        owner = await session.scalar(
            select(Transition.episode_id).where(Transition.id == transition_id)
        )
        if owner is None:
            pending, transition_id = {"pending_transition_id": transition_id}, None
        elif owner != episode_id:
            raise UnknownTransition(f"no transition {transition_id} in episode {episode_id!r}")
    else:
        await session.execute(
            update(Episode)
            .where(Episode.id == episode_id)
            .values(final_reward=value, final_reward_at=func.now())
        )

    inserted = await session.scalar(
        insert(Reward)
        .values(
            episode_id=episode_id,
            transition_id=transition_id,
            value=value,
            source=source,
            idempotency_key=idempotency_key,
            **pending,
        )
        .on_conflict_do_nothing(index_elements=["episode_id", "idempotency_key"])
        .returning(Reward.id)
    )
    if inserted is None:  # only if the episode lock were bypassed; the key is stored
        return "duplicate", transition_id, 0
    if pending:
        return "pending", None, 0
    credited = await credit_episodes([episode_id], session=session, gamma=gamma, strict=True)
    return "accepted", transition_id, credited


async def attach_pending_rewards(records: list[TransitionRecord], *, session: AsyncSession) -> None:
    """Step rewards that arrived before these transitions were stored now name them (by id, or
    by a tool call they made). Runs after the episode rows are locked: a reward transaction that
    saw no transition either committed its pending row before, or sees the transitions after."""
    calls = [(r.episode_id, str(c["id"]), r.id) for r in records for c in r.tool_calls or ()
             if isinstance(c, dict) and c.get("id")]  # fmt: skip
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


# --- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeRows:
    episode: Episode
    transitions: list[Transition]  # in call order
    messages: dict[bytes, Any]  # digest -> body, for every prompt message of the transitions
    rewards: list[Reward]  # as posted


async def get_episode(episode_id: str, *, session: AsyncSession) -> EpisodeRows | None:
    episode = await session.get(Episode, episode_id)
    if episode is None:
        return None
    transitions = (
        await session.scalars(
            select(Transition)
            .where(Transition.episode_id == episode_id)
            .order_by(Transition.requested_at, Transition.request_id, Transition.choice_index)
        )
    ).all()
    digests = {d for t in transitions for d in t.message_digests}
    bodies: dict[bytes, Any] = {}
    if digests:
        rows = await session.execute(
            select(Message.digest, Message.body).where(Message.digest.in_(digests))
        )
        bodies = {digest: body for digest, body in rows}
    rewards = (
        await session.scalars(
            select(Reward).where(Reward.episode_id == episode_id).order_by(Reward.id)
        )
    ).all()
    return EpisodeRows(episode, list(transitions), bodies, list(rewards))
