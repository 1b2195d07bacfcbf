"""Recorded data out: transitions to JSON Lines or Parquet, streamed in constant memory.

    flywheel export out.jsonl [--kind transitions|sft|pairs|demonstrations] [--tokens] [filters]

Four kinds of row:
- `transitions`: one per recorded call, as `GET /v1/episodes/{id}` shows it (prompt messages,
  completion, tool calls, version, return, step rewards, the episode's final reward), with
  `--tokens` the exact prompt/completion token ids and behaviour logprobs.
- `sft`: chat-format rows for supervised fine-tuning elsewhere (TRL's `messages` + `tools`):
  the prompt messages and the completion as the assistant's message. Chat calls that succeeded.
- `pairs`: preference pairs (TRL's conversational `prompt` / `chosen` / `rejected`) from each
  group of calls with the same task, agent and prompt messages: its highest-return completion
  against its lowest, where the returns differ. Credited chat calls that succeeded.
- `demonstrations`: what the trainer imitates (POST /v1/demonstrations), as `sft` rows (the
  prompt, then the answer) with their lineage, tenant, source and how far they were trained;
  `--tokens` adds a copied call's exact token ids. Filters: since/until (when posted), agent,
  task, lineage, trained.

The rows stream from a server-side cursor (`itersize` at a time), so memory does not grow with
the table; Parquet is written a row group at a time. In Parquet the JSON-valued fields (messages,
params, tool calls, rewards) are JSON text; token ids and logprobs are lists. Both load with one
line of Hugging Face `datasets` (docs/guide/operating.md, "Export").
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from core import database
from core.export_files import write_jsonl, write_parquet
from core.export_kinds import (
    DEMONSTRATION_TOKEN_COLUMNS,
    DEMONSTRATIONS_SQL,
    PAIRS_SQL,
    TOKEN_COLUMNS,
    TRANSITIONS_SQL,
    Pairer,
    columns,
    demonstration_row,
    sft_row,
    transition_row,
)
from core.tenants import OPERATOR, Principal

KINDS = ("transitions", "sft", "pairs", "demonstrations")
FORMATS = ("jsonl", "parquet")
BATCH = 2000  # rows fetched per round trip, and per Parquet row group


@dataclass(frozen=True)
class ExportFilter:
    """Which transitions: every field None means no condition. Ids are the caller's (public)."""

    principal: Principal = OPERATOR  # a tenant's own rows under its own ids, or every row
    since: datetime | None = None  # requested at or after
    until: datetime | None = None  # requested before
    agent: str | None = None
    task: str | None = None
    version: int | None = None  # policy version that served it (0: the base model)
    lineage: str | None = None
    min_reward: float | None = None  # the episode's final reward
    max_reward: float | None = None
    trained: bool | None = None  # used by the trainer already, or not yet


@dataclass(frozen=True)
class Exported:
    rows: int
    seconds: float
    path: Path


def export(
    database_url: str,
    path: Path,
    *,
    kind: str = "transitions",
    fmt: str | None = None,
    where: ExportFilter | None = None,
    tokens: bool = False,
    batch: int = BATCH,
) -> Exported:
    """Write the rows to `path` (the format from its suffix unless `fmt`); a partial file is
    never left under that name (written next to it, renamed at the end)."""
    fmt = fmt or ("parquet" if path.suffix == ".parquet" else "jsonl")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    q = query(kind, where or ExportFilter(), tokens=tokens)  # (before a file is opened)
    started = time.perf_counter()
    partial = path.with_name(f".{path.name}.partial")
    engine, sessions = database.create_sessions(database_url)
    try:
        with sessions() as session:
            produced = rows(q, batch=batch, session=session)
            if fmt == "parquet":
                count = write_parquet(produced, partial, columns(kind, tokens), batch)
            else:
                count = write_jsonl(produced, partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        engine.dispose()
    partial.replace(path)
    return Exported(count, time.perf_counter() - started, path)


# --- the rows ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """An export as SQL and what makes each of its rows an export row (None: nothing yet; the
    pairs shaper holds a group's best row until its worst comes)."""

    sql: str
    params: dict[str, Any]
    shape: Callable[[dict[str, Any]], dict[str, Any] | None]


def query(kind: str, where: ExportFilter, *, tokens: bool = False) -> Query:
    """The export's query; the CLI runs it on a sync session (`rows`), the proxy's
    GET /v1/export on an async one. Both stream it through a server-side cursor."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    public = where.principal.public
    if kind == "demonstrations":
        conditions, params = _demonstration_conditions(where)
        sql = DEMONSTRATIONS_SQL.format(
            tokens=DEMONSTRATION_TOKEN_COLUMNS if tokens else "", where=" AND ".join(conditions)
        )
        return Query(sql, params, functools.partial(demonstration_row, public=public))
    conditions, params = _conditions(where)
    if kind == "transitions":
        sql = TRANSITIONS_SQL.format(
            tokens=TOKEN_COLUMNS if tokens else "", where=" AND ".join(conditions)
        )
        return Query(sql, params, functools.partial(transition_row, public=public))
    if kind == "sft":
        conditions += ["t.status = 'ok'", "t.route = 'chat'"]
        sql = TRANSITIONS_SQL.format(tokens="", where=" AND ".join(conditions))
        return Query(sql, params, functools.partial(sft_row, public=public))
    conditions += ["t.status = 'ok'", "t.route = 'chat'", 't."return" IS NOT NULL']
    return Query(PAIRS_SQL.format(where=" AND ".join(conditions)), params, Pairer(public))


def rows(q: Query, *, batch: int = BATCH, session: Session) -> Iterator[dict[str, Any]]:
    """The export's rows, read through a server-side cursor (`batch` rows a round trip)."""
    result = session.execute(text(q.sql), q.params, execution_options={"yield_per": batch})
    for row in result.mappings():
        out = q.shape(dict(row))
        if out is not None:
            yield out


def _conditions(where: ExportFilter) -> tuple[list[str], dict[str, Any]]:
    owns, owner = where.principal.owns_episode_sql("t.episode_id")
    conditions, params = [owns], dict[str, Any](owner)
    own = where.principal.own
    for column, value, op in [
        ("t.requested_at", where.since, ">="),
        ("t.requested_at", where.until, "<"),
        ("t.agent_name", where.agent, "="),
        ("t.task_id", own(where.task) if where.task is not None else None, "="),
        ("t.policy_version", where.version, "="),
        ("t.lineage", where.lineage, "="),
        ("e.final_reward", where.min_reward, ">="),
        ("e.final_reward", where.max_reward, "<="),
    ]:
        if value is not None:
            name = f"p{len(params)}"
            params[name] = value
            conditions.append(f"{column} {op} :{name}")
    if where.trained is not None:
        conditions.append(f"t.trained_at IS {'NOT ' if where.trained else ''}NULL")
    return conditions, params


def _demonstration_conditions(where: ExportFilter) -> tuple[list[str], dict[str, Any]]:
    principal = where.principal
    if where.version is not None or where.min_reward is not None or where.max_reward is not None:
        raise ValueError(
            "demonstrations have no version or reward: filter them by since, until, agent, "
            "task, lineage or trained"
        )
    conditions: list[str] = []
    params: dict[str, Any] = {}
    if not principal.every_tenant:
        conditions.append("d.tenant IS NULL" if principal.tenant is None else "d.tenant = :tenant")
        params["tenant"] = principal.tenant
    for column, value, op in [
        ("d.created_at", where.since, ">="),
        ("d.created_at", where.until, "<"),
        ("d.agent_name", where.agent, "="),
        ("d.task_id", principal.own(where.task) if where.task is not None else None, "="),
        ("d.lineage", where.lineage, "="),
    ]:
        if value is not None:
            name = f"p{len(params)}"
            params[name] = value
            conditions.append(f"{column} {op} :{name}")
    if where.trained is not None:
        conditions.append(f"d.epochs {'>' if where.trained else '='} 0")
    return conditions or ["TRUE"], params
