"""Recording: the background writer's batch of transitions into Postgres, prompts stored by
content, with the rewards and credit that writing them settles (store/rewards.py).
"""

from __future__ import annotations

from collections.abc import Container
from datetime import UTC, date, datetime
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy.ext.asyncio import AsyncSession

from core.codecs import PackedDigests, PromptMemo, pack, pack_digests, split_blocks
from core.pgcopy import copy_insert
from core.record import TRANSITION_COLUMNS, TransitionRecord, copy_row
from proxy.record.store.episodes import lock_episodes
from proxy.record.store.rewards import add_air_rewards, attach_pending_rewards, credit_episodes

MESSAGE_COLUMNS = (("digest", "bytea"), ("body", "jsonb"), ("last_used", "date"))
# A message stored already is marked used until at least this batch's day (core/retention.py).
MESSAGE_CONFLICT = (
    "(digest) DO UPDATE SET last_used = excluded.last_used "
    "WHERE message.last_used < excluded.last_used"
)

BLOCK_COLUMNS = (("digest", "bytea"), ("ids", "bytea"), ("last_used", "date"))
BLOCK_CONFLICT = MESSAGE_CONFLICT.replace("message.", "token_block.")


async def insert_transitions(
    records: list[TransitionRecord],
    *,
    session: AsyncSession,
    gamma: float | None,
    air_penalty: float | None = None,
    stored: Container[bytes] = frozenset(),
    today: date | None = None,
    memo: PromptMemo | None = None,
) -> list[bytes]:
    """Write recorded transitions (idempotent by id: journal replays may repeat some), with an
    `air` reward of -air_penalty for each one whose tool calls AIR found wrong
    (proxy/record/air.py).

    Prompts are stored by content: each message once (`message`), and the token ids' whole
    blocks once (`token_block`, core/codecs.py). Those whose digest is in `stored` (known to be
    committed already, with a `last_used` of `today` or later) are not sent again; the ones sent
    are marked used until at least `today` (UTC, by default now) and the day of every record.
    `memo`: the writer's digests of each episode's previous prompt, so that only what is new in
    a prompt is hashed (core/codecs.py). Returns the digests it sent: stored once the caller
    commits.
    """
    episodes: dict[str, str | None] = {}
    last_calls: dict[str, float] = {}
    for r in records:
        episodes[r.episode_id] = episodes.get(r.episode_id) or r.task_id
        last_calls[r.episode_id] = max(last_calls.get(r.episode_id, 0.0), r.requested_at)
    await lock_episodes(episodes, session=session, last_calls=last_calls)
    newest = datetime.fromtimestamp(max(last_calls.values(), default=0.0), UTC)
    last_used = max(today or datetime.now(UTC).date(), newest.date())

    messages: dict[bytes, Any] = {}
    blocks: dict[bytes, bytes] = {}
    # The n choices of one request share one prompt list and (chat) one list of prompt token
    # ids: hash and pack those once (the records hold the lists alive, so ids stay unique here).
    packed_by_prompt: dict[int, tuple[list[bytes], PackedDigests]] = {}
    packed_prompt_ids: dict[int, tuple[PackedDigests | None, bytes | None]] = {}
    rows = []
    memo = memo if memo is not None else PromptMemo()
    for r in records:
        prompt = r.messages
        named_messages = packed_by_prompt.get(id(prompt))
        if named_messages is None:
            digests = memo.message_digests(r.episode_id, prompt)
            for body, digest in zip(prompt, digests, strict=True):
                if digest not in stored:
                    # JSON null (a client sent `null` for a message) is a value, not SQL NULL.
                    messages[digest] = Jsonb(None) if body is None else body
            named_messages = packed_by_prompt[id(prompt)] = (digests, pack_digests(digests))
        digests, packed = named_messages
        prompt_ids = r.prompt_token_ids
        split = packed_prompt_ids.get(id(prompt_ids))
        if split is None:
            packed_ids = pack(prompt_ids, "i")
            block_digests, block_ids, rest = split_blocks(
                packed_ids, known=memo.known_blocks(r.episode_id)
            )
            for digest, ids in zip(block_digests, block_ids, strict=True):
                if digest not in stored:
                    blocks[digest] = ids
            memo.remember(r.episode_id, prompt, digests, packed_ids, block_digests)
            named = pack_digests(block_digests) if block_digests else None
            split = packed_prompt_ids[id(prompt_ids)] = (named, rest)
        rows.append(copy_row(r, packed, *split))
    content: tuple[tuple[str, Any, str, dict[bytes, Any]], ...] = (
        ("message", MESSAGE_COLUMNS, MESSAGE_CONFLICT, messages),
        ("token_block", BLOCK_COLUMNS, BLOCK_CONFLICT, blocks),
    )
    for table, columns, conflict, new in content:
        if new:  # in digest order: two writers inserting the same new ones never deadlock
            rows_in_order = [(digest, value, last_used) for digest, value in sorted(new.items())]
            await copy_insert(session, table, columns, rows_in_order, on_conflict=conflict)
    await copy_insert(session, "transition", TRANSITION_COLUMNS, rows)
    if air_penalty is not None:
        await add_air_rewards([r for r in records if r.tool_errors], -air_penalty, session=session)
    await attach_pending_rewards(records, session=session)
    await credit_episodes(sorted(episodes), session=session, gamma=gamma)
    return [*messages, *blocks]
