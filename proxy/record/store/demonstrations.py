"""Demonstrations as posted: a prompt with its answer, or copies of a recorded episode's calls
(their token ids as sampled). Idempotent: a posted one by its key (unique per lineage), a copied
call by its transition (copying an episode again adds nothing). The trainer's side is
trainer/data/store.py."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, text, tuple_
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from core.tables import PROMPT_IDS_SQL, Demonstration


@dataclass(frozen=True)
class Added:
    id: uuid.UUID
    lineage: str
    status: str  # "created" | "duplicate"
    transition_id: uuid.UUID | None = None


async def add_posted(rows: list[dict[str, Any]], *, session: AsyncSession) -> list[Added]:
    """Insert posted demonstrations (each a `Demonstration` row's values, `id` included); one
    whose (lineage, idempotency_key) is stored already is a "duplicate" of that row."""
    inserted = set(
        (
            await session.execute(
                insert(Demonstration)
                .values(rows)
                .on_conflict_do_nothing(index_elements=["lineage", "idempotency_key"])
                .returning(Demonstration.id)
            )
        ).scalars()
    )
    keys = [(r["lineage"], r["idempotency_key"]) for r in rows if r["id"] not in inserted]
    existing: dict[tuple[str, str | None], uuid.UUID] = {}
    if keys:
        found = await session.execute(
            select(Demonstration.lineage, Demonstration.idempotency_key, Demonstration.id).where(
                tuple_(Demonstration.lineage, Demonstration.idempotency_key).in_(keys)
            )
        )
        existing = {(lineage, key): id_ for lineage, key, id_ in found.all()}
    return [
        Added(r["id"], r["lineage"], "created")
        if r["id"] in inserted
        else Added(existing[(r["lineage"], r["idempotency_key"])], r["lineage"], "duplicate")
        for r in rows
    ]


_COPYABLE = """
FROM transition t
WHERE t.episode_id = :episode_id AND t.status = 'ok' AND t.lineage IS NOT NULL
  AND t.completion_token_ids IS NOT NULL
  AND (t.prompt_token_ids IS NOT NULL OR t.prompt_blocks IS NOT NULL)
  AND (CAST(:lineage AS text) IS NULL OR t.lineage = :lineage)
  AND (CAST(:agent AS text) IS NULL OR t.agent_name = :agent)
"""


async def copy_episode(
    episode_id: str,
    *,
    tenant: str | None,
    lineage: str | None,
    agent: str | None,
    session: AsyncSession,
) -> list[Added]:
    """Every recorded call of the episode (stored id) that a lineage served, with its token ids,
    as a demonstration of that lineage (only `lineage`'s or `agent`'s calls, if given). A call
    copied before is a "duplicate". Empty: the episode has no such call."""
    params = {"episode_id": episode_id, "lineage": lineage, "agent": agent, "tenant": tenant}
    created = (
        await session.execute(
            text(
                "INSERT INTO demonstration (id, lineage, tenant, source, episode_id, task_id, "
                "agent_name, transition_id, prompt_token_ids, completion_token_ids, "
                "idempotency_key) "
                "SELECT gen_random_uuid(), t.lineage, :tenant, 'episode', t.episode_id, "
                f"t.task_id, t.agent_name, t.id, {PROMPT_IDS_SQL.format(row='t')}, "
                f"t.completion_token_ids, 'episode:' || t.id::text {_COPYABLE} "
                "ON CONFLICT (lineage, idempotency_key) DO NOTHING "
                "RETURNING id, lineage, transition_id"
            ),
            params,
        )
    ).all()
    copied = {row.transition_id for row in created}
    before = (
        await session.execute(
            text(
                "SELECT d.id, d.lineage, d.transition_id FROM demonstration d JOIN ("
                f"SELECT t.id, t.lineage {_COPYABLE}) c ON d.transition_id = c.id "
                "AND d.lineage = c.lineage AND d.source = 'episode'"
            ),
            params,
        )
    ).all()
    return [Added(r.id, r.lineage, "created", r.transition_id) for r in created] + [
        Added(r.id, r.lineage, "duplicate", r.transition_id)
        for r in before
        if r.transition_id not in copied
    ]


async def episode_exists(episode_id: str, *, session: AsyncSession) -> bool:
    found = await session.execute(text("SELECT 1 FROM episode WHERE id = :id"), {"id": episode_id})
    return found.first() is not None
