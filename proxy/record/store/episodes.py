"""The episode rows: the lock every transaction takes before it touches transitions, and one
episode read back whole (its transitions, their messages and prompts, its rewards).

Lock order, to make writer and reward transactions see each other: both first upsert the episode
rows they touch (`lock_episodes`, which row-locks them, in sorted id order), then read or write
transitions. Whoever commits second sees the first one's rows, so a reward and its transitions
always meet.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from core.tables import PROMPT_IDS_SQL, Episode, Message, Reward, Transition


async def lock_episodes(
    episodes: dict[str, str | None],
    *,
    session: AsyncSession,
    last_calls: dict[str, float] | None = None,
) -> None:
    """Create missing episode rows and row-lock all of them, in id order (no deadlocks); with
    `last_calls` (unix seconds by episode), move each one's `last_call_at` up to its newest.

    Retention deletes an episode only while its `last_call_at` is older than its cutoff, under
    this same row lock (core/retention.py): a call being written keeps its episode."""
    if not episodes:
        return
    ids = sorted(episodes)
    times = [
        None if last_calls is None else datetime.fromtimestamp(last_calls[i], UTC) for i in ids
    ]
    # Array parameters, not a VALUES row per episode: a batch of interleaved episodes has
    # hundreds, and building that statement cost the writer more than packing their token ids.
    await session.execute(
        text(
            "INSERT INTO episode (id, task_id, last_call_at) SELECT * FROM unnest("
            "CAST(:ids AS text[]), CAST(:task_ids AS text[]), CAST(:times AS timestamptz[])) "
            "ON CONFLICT (id) DO UPDATE SET task_id = coalesce(episode.task_id, excluded.task_id),"
            " last_call_at = greatest(episode.last_call_at, excluded.last_call_at)"
        ),
        {"ids": ids, "task_ids": [episodes[i] for i in ids], "times": times},
    )


@dataclass(frozen=True)
class EpisodeRows:
    episode: Episode
    transitions: list[Transition]  # in call order
    messages: dict[bytes, Any]  # digest -> body, for every prompt message of the transitions
    rewards: list[Reward]  # as posted
    # Transition id -> its whole packed prompt ids, for the transitions stored in blocks (the
    # others' are their `prompt_token_ids`): `prompt_ids()` picks.
    prompts: dict[uuid.UUID, bytes]

    def prompt_ids(self, t: Transition) -> bytes | None:
        return self.prompts.get(t.id, t.prompt_token_ids)


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
    prompts: dict[uuid.UUID, bytes] = {}
    if any(t.prompt_blocks for t in transitions):
        rows = await session.execute(
            text(
                f"SELECT t.id, {PROMPT_IDS_SQL.format(row='t')} FROM transition t "
                "WHERE t.episode_id = :e AND t.prompt_blocks IS NOT NULL"
            ),
            {"e": episode_id},
        )
        prompts = {tid: ids for tid, ids in rows}
    rewards = (
        await session.scalars(
            select(Reward).where(Reward.episode_id == episode_id).order_by(Reward.id)
        )
    ).all()
    return EpisodeRows(episode, list(transitions), bodies, list(rewards), prompts)
