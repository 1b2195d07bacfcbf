"""All SQL of the proxy. Functions take `*, session` and never commit: callers own transactions.

Lock order, to make writer and reward transactions see each other: both first upsert the episode
rows they touch (which row-locks them, in sorted id order), then read or write transitions. Whoever
commits second sees the first one's rows, so a reward and its transitions always meet.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
import uuid
from array import array
from collections.abc import Container, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
import psycopg
from psycopg.abc import Buffer
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.types.json import set_json_dumps
from sqlalchemy import ARRAY, Text, any_, bindparam, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from proxy.credit import Step, assign_returns
from proxy.tables import AdapterVersion, Episode, Message, Reward, Transition

set_json_dumps(orjson.dumps)  # psycopg's JSON for jsonb columns: orjson's, as everywhere here

# --- packing: token ids as int32, logprobs as float32, little-endian --------------------------


def pack(values: list[int] | list[float] | None, typecode: str) -> bytes | None:
    # struct packs a list ~2.5x faster than array(typecode, list) does (this is the writer's
    # biggest per-row cost: prompts of thousands of token ids), and "<" fixes the byte order.
    if values is None:
        return None
    return struct.pack(f"<{len(values)}{typecode}", *values)


def unpack(data: bytes | None, typecode: str) -> list[Any] | None:
    if data is None:
        return None
    values = array(typecode)
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def message_digest(body: Any) -> bytes:
    if (
        type(body) is dict
        and len(body) == 2
        and type(role := body.get("role")) is str
        and type(content := body.get("content")) is str
        and len(content) <= MEMO_MAX_CHARS
    ):
        return _chat_message_digest(role, content)
    return _digest(body)


def _digest(body: Any) -> bytes:
    return hashlib.blake2b(orjson.dumps(body, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()


# A system prompt and an episode's history come back in every call, each time as new objects:
# hashing the text (Python's str hash) to find its digest costs a fraction of serialising and
# BLAKE2b-hashing it again. Bounded: at most MEMO_SIZE texts of at most MEMO_MAX_CHARS.
MEMO_SIZE, MEMO_MAX_CHARS = 8192, 2048


@functools.lru_cache(maxsize=MEMO_SIZE)
def _chat_message_digest(role: str, content: str) -> bytes:
    return _digest({"role": role, "content": content})


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


async def insert_transitions(
    records: list[dict[str, Any]],
    *,
    session: AsyncSession,
    gamma: float | None,
    stored_messages: Container[bytes] = frozenset(),
) -> list[bytes]:
    """Write recorded transitions (idempotent by id: journal replays may repeat some).

    Messages whose digest is in `stored_messages` (known to be committed already) are not sent
    again. Returns the digests of the messages it sent: stored once the caller commits.
    """
    episodes: dict[str, str | None] = {}
    for r in records:
        episodes[r["episode_id"]] = episodes.get(r["episode_id"]) or r.get("task_id")
    await lock_episodes(episodes, session=session)

    messages: dict[bytes, Any] = {}
    # The n choices of one request share one prompt list and (chat) one list of prompt token
    # ids: hash and pack those once (the records hold the lists alive, so ids stay unique here).
    packed_by_prompt: dict[int, PackedDigests] = {}
    packed_prompt_ids: dict[int, bytes | None] = {}
    rows = []
    for r in records:
        prompt = r["messages"]
        packed = packed_by_prompt.get(id(prompt))
        if packed is None:
            digests = []
            for body in prompt:
                digest = message_digest(body)
                if digest not in stored_messages:
                    messages[digest] = body
                digests.append(digest)
            packed = packed_by_prompt[id(prompt)] = _pack_digests(digests)
        prompt_ids = r.get("prompt_token_ids")
        if id(prompt_ids) not in packed_prompt_ids:
            packed_prompt_ids[id(prompt_ids)] = pack(prompt_ids, "i")
        rows.append(_transition_row(r, packed, packed_prompt_ids[id(prompt_ids)]))
    if messages:
        # In digest order: two writers inserting the same new messages never deadlock.
        await copy_insert(session, "message", MESSAGE_COLUMNS, sorted(messages.items()))
    await copy_insert(session, "transition", TRANSITION_COLUMNS, rows)
    await credit_episodes(sorted(episodes), session=session, gamma=gamma)
    return list(messages)


# Column names and Postgres types of the binary COPY, in row order.
MESSAGE_COLUMNS = (("digest", "bytea"), ("body", "jsonb"))
TRANSITION_COLUMNS = (
    ("id", "uuid"),
    ("episode_id", "text"),
    ("request_id", "uuid"),
    ("choice_index", "int2"),
    ("task_id", "text"),
    ("agent_name", "text"),
    ("requested_at", "timestamptz"),
    ("route", "text"),
    ("status", "text"),
    ("http_status", "int2"),
    ("model_requested", "text"),
    ("model_used", "text"),
    ("policy_version", "int4"),
    ("message_digests", "bytea[]"),
    ("params", "jsonb"),
    ("prompt_token_ids", "bytea"),
    ("completion_token_ids", "bytea"),
    ("logprobs", "bytea"),
    ("text", "text"),
    ("tool_calls", "jsonb"),
    ("finish_reason", "text"),
    ("error", "jsonb"),
    ("latency_ms", "float8"),
    ("prompt_tokens", "int4"),
    ("completion_tokens", "int4"),
)


async def copy_insert(
    session: AsyncSession,
    table: str,
    columns: Sequence[tuple[str, str]],
    rows: list[tuple[Any, ...]],
) -> None:
    """Binary COPY of `rows` into `table`, skipping rows whose key is there already.

    COPY is one round trip for the whole batch (an executemany runs one INSERT per row), and
    binary COPY sends packed bytes as they are (text COPY escapes every bytea byte). COPY cannot
    skip duplicates, so it goes straight into the table under a savepoint; only when that meets
    a row already there (a journal replay, a message another writer stored) do the rows go
    through a per-connection temporary table and INSERT ... ON CONFLICT DO NOTHING.
    """
    names = ", ".join(f'"{name}"' for name, _ in columns)
    types = [pg_type for _, pg_type in columns]
    connection = await session.connection()
    raw = (await connection.get_raw_connection()).driver_connection
    assert raw is not None, "the session's connection is closed"
    async with raw.cursor() as cursor:
        cursor.adapters.register_dumper(PackedDigests, PackedDigestsDumper)
        cursor.adapters.register_dumper(PackedUuid, PackedUuidDumper)
        await cursor.execute("SAVEPOINT copy_insert")
        try:
            await _copy(cursor, table, names, types, rows)
        except psycopg.errors.UniqueViolation:
            await cursor.execute("ROLLBACK TO SAVEPOINT copy_insert")
        else:
            await cursor.execute("RELEASE SAVEPOINT copy_insert")
            return
        await cursor.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {table}_in (LIKE {table}) ON COMMIT DELETE ROWS"
        )
        await _copy(cursor, f"{table}_in", names, types, rows)
        await cursor.execute(
            f"INSERT INTO {table} ({names}) SELECT {names} FROM {table}_in ON CONFLICT DO NOTHING"
        )


async def _copy(
    cursor: psycopg.AsyncCursor[Any],
    table: str,
    names: str,
    types: list[str],
    rows: list[tuple[Any, ...]],
) -> None:
    async with cursor.copy(f"COPY {table} ({names}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(types)
        for row in rows:
            await copy.write_row(row)


# Values packed here in Postgres's binary format, sent as they are. COPY picks a column's dumper
# by the type given to set_types(); registering these (per COPY cursor) makes them the dumpers
# for `bytea[]` and `uuid`, in place of psycopg's per-element and per-object Python ones.
BYTEA_OID, BYTEA_ARRAY_OID, UUID_OID = 17, 1001, 2950


class PackedDigests(bytes):
    """A `bytea[]` of 16-byte digests in Postgres's binary array format."""


class PackedUuid(bytes):
    """A uuid's 16 bytes."""


class _AsIs(Dumper):
    format = Format.BINARY

    def dump(self, obj: Any) -> Buffer:
        return obj  # type: ignore[no-any-return]


class PackedDigestsDumper(_AsIs):
    oid = BYTEA_ARRAY_OID


class PackedUuidDumper(_AsIs):
    oid = UUID_OID


# The binary array: ndim, has-nulls flag, element oid, (length, lower bound) of the one dimension,
# then each element as its 4-byte length and its bytes. An empty array has no dimensions.
_EMPTY_ARRAY = struct.pack(">iiI", 0, 0, BYTEA_OID)
_DIGEST_LENGTH = struct.pack(">i", 16)


def _pack_digests(digests: list[bytes]) -> PackedDigests:
    if not digests:
        return PackedDigests(_EMPTY_ARRAY)
    header = struct.pack(">iiIii", 1, 0, BYTEA_OID, len(digests), 1)
    return PackedDigests(header + _DIGEST_LENGTH + _DIGEST_LENGTH.join(digests))


def _packed_uuid(value: str) -> bytes:
    # 5x cheaper than uuid.UUID(value).bytes; Postgres refuses anything but 16 bytes.
    return bytes.fromhex(value.replace("-", ""))


def _transition_row(
    r: dict[str, Any], digests: PackedDigests, prompt_token_ids: bytes | None
) -> tuple[Any, ...]:
    return (
        _packed_uuid(r["id"]),
        r["episode_id"],
        _packed_uuid(r["request_id"]),
        r["choice_index"],
        r.get("task_id"),
        r.get("agent_name"),
        datetime.fromtimestamp(r["requested_at"], UTC),
        r["route"],
        r["status"],
        r["http_status"],
        r.get("model_requested"),
        r.get("model_used"),
        r.get("policy_version"),
        digests,
        r.get("params") or {},
        prompt_token_ids,
        pack(r.get("completion_token_ids"), "i"),
        pack(r.get("logprobs"), "f"),
        r.get("text"),
        r.get("tool_calls"),
        r.get("finish_reason"),
        r.get("error"),
        r["latency_ms"],
        r.get("prompt_tokens"),
        r.get("completion_tokens"),
    )


# --- credit ----------------------------------------------------------------------------------


async def credit_episodes(
    episode_ids: list[str], *, session: AsyncSession, gamma: float | None
) -> int:
    """(Re)compute the return of every untrained transition of these episodes that have a final
    reward. Returns how many transitions were credited."""
    if not episode_ids:
        return 0
    step_reward = (
        select(func.coalesce(func.sum(Reward.value), 0.0))
        .where(Reward.transition_id == Transition.id)
        .scalar_subquery()
    )
    result = await session.execute(
        select(
            Transition.episode_id,
            Transition.id,
            Transition.request_id,
            Transition.requested_at,
            step_reward,
            Episode.final_reward,
        )
        .join(Episode, Episode.id == Transition.episode_id)
        .where(
            Transition.episode_id == any_(bindparam("episode_ids", episode_ids, ARRAY(Text))),
            Episode.final_reward.is_not(None),
        )
    )
    by_episode: dict[str, tuple[float, list[Step]]] = {}
    for episode_id, tid, rid, at, r_step, final in result:
        by_episode.setdefault(episode_id, (final, []))[1].append(Step(tid, rid, at, r_step))
    returns: dict[uuid.UUID, float] = {}
    for final, steps in by_episode.values():
        returns.update(assign_returns(steps, final, gamma))
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


async def add_reward(
    *,
    session: AsyncSession,
    episode_id: str,
    value: float,
    transition_id: uuid.UUID | None,
    idempotency_key: str | None,
    gamma: float | None,
) -> tuple[bool, int]:
    """Record one reward and re-credit its episode. Returns (duplicate, transitions credited)."""
    await lock_episodes({episode_id: None}, session=session)
    if idempotency_key is not None:
        seen = await session.scalar(
            select(Reward.id).where(Reward.idempotency_key == idempotency_key)
        )
        if seen is not None:
            return True, 0

    trained = select(Transition.id).where(
        Transition.episode_id == episode_id, Transition.trained_at.is_not(None)
    )
    if transition_id is None:
        previous = await session.scalar(
            select(Episode.final_reward).where(Episode.id == episode_id)
        )
        if previous is not None and previous != value and await session.scalar(trained.limit(1)):
            raise RewardConflict(
                f"episode {episode_id!r} was already trained on with final reward {previous}; "
                "its final reward can no longer change"
            )
        await session.execute(
            update(Episode)
            .where(Episode.id == episode_id)
            .values(final_reward=value, final_reward_at=func.now())
        )
    else:
        row = (
            await session.execute(
                select(Transition.episode_id, Transition.trained_at).where(
                    Transition.id == transition_id
                )
            )
        ).first()
        if row is None or row.episode_id != episode_id:
            raise UnknownTransition(f"no transition {transition_id} in episode {episode_id!r}")
        if row.trained_at is not None:
            raise RewardConflict(f"transition {transition_id} was already trained on")

    await session.execute(
        insert(Reward).values(
            episode_id=episode_id,
            transition_id=transition_id,
            value=value,
            idempotency_key=idempotency_key,
        )
    )
    return False, await credit_episodes([episode_id], session=session, gamma=gamma)


# --- reading ---------------------------------------------------------------------------------


async def get_episode(
    episode_id: str, *, session: AsyncSession, tokens: bool
) -> dict[str, Any] | None:
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
    return {
        "id": episode.id,
        "object": "episode",
        "task_id": episode.task_id,
        "final_reward": episode.final_reward,
        "created_at": episode.created_at.isoformat(),
        "transitions": [_transition_json(t, bodies, tokens) for t in transitions],
        "rewards": [
            {
                "id": r.id,
                "transition_id": str(r.transition_id) if r.transition_id else None,
                "reward": r.value,
                "idempotency_key": r.idempotency_key,
                "created_at": r.created_at.isoformat(),
            }
            for r in rewards
        ],
    }


def _transition_json(t: Transition, bodies: dict[bytes, Any], tokens: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": str(t.id),
        "request_id": str(t.request_id),
        "choice_index": t.choice_index,
        "task_id": t.task_id,
        "agent_name": t.agent_name,
        "requested_at": t.requested_at.isoformat(),
        "route": t.route,
        "status": t.status,
        "http_status": t.http_status,
        "model_requested": t.model_requested,
        "model_used": t.model_used,
        "policy_version": t.policy_version,
        "messages": [bodies.get(d) for d in t.message_digests],
        "params": t.params,
        "text": t.text,
        "tool_calls": t.tool_calls,
        "finish_reason": t.finish_reason,
        "error": t.error,
        "latency_ms": t.latency_ms,
        "usage": {"prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens},
        "return": t.return_,
        "credited_at": t.credited_at.isoformat() if t.credited_at else None,
        "trained_at": t.trained_at.isoformat() if t.trained_at else None,
    }
    if tokens:
        out["prompt_token_ids"] = unpack(t.prompt_token_ids, "i")
        out["completion_token_ids"] = unpack(t.completion_token_ids, "i")
        out["logprobs"] = unpack(t.logprobs, "f")
    return out


# --- adapter versions (the trainer writes them; the alias reads them) -------------------------


async def current_adapter(*, session: AsyncSession) -> tuple[int, str] | None:
    row = (
        await session.execute(
            select(AdapterVersion.version, AdapterVersion.name).where(AdapterVersion.is_current)
        )
    ).first()
    return (row.version, row.name) if row else None


async def adapter_name(version: int, *, session: AsyncSession) -> str | None:
    name: str | None = await session.scalar(
        select(AdapterVersion.name).where(AdapterVersion.version == version)
    )
    return name


async def list_adapters(*, session: AsyncSession) -> list[dict[str, Any]]:
    rows = await session.scalars(select(AdapterVersion).order_by(AdapterVersion.version))
    return [
        {
            "version": a.version,
            "name": a.name,
            "path": a.path,
            "is_current": a.is_current,
            "created_at": a.created_at.isoformat(),
            "trained_transitions": a.trained_transitions,
            "stats": a.stats,
        }
        for a in rows
    ]


# Taken (for the transaction) by everyone who moves `is_current`: the trainer's publish and the
# proxy's rollback. Without it two publishers both clear the flag, then collide on setting it.
PUBLISH_LOCK = 7239012
# ...and who moves it also NOTIFYs here (delivered on commit): proxies refresh their alias at once.
POLICY_CHANNEL = "flywheel_policy"
NOTIFY_POLICY = text(f"NOTIFY {POLICY_CHANNEL}")


async def set_current(version: int | None, *, session: AsyncSession) -> None:
    """Point the alias at `version`, or at the base model (None)."""
    await session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PUBLISH_LOCK})
    await session.execute(
        update(AdapterVersion).where(AdapterVersion.is_current).values(is_current=False)
    )
    if version is not None:
        await session.execute(
            update(AdapterVersion).where(AdapterVersion.version == version).values(is_current=True)
        )
    await session.execute(NOTIFY_POLICY)


async def adapter_path(name: str, *, session: AsyncSession) -> str | None:
    path: str | None = await session.scalar(
        select(AdapterVersion.path).where(AdapterVersion.name == name)
    )
    return path
