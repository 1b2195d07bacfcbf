"""Recorded data out: transitions to JSON Lines or Parquet, streamed in constant memory.

    flywheel export out.jsonl [--kind transitions|sft|pairs] [--tokens] [filters]

Three kinds of row:
- `transitions`: one per recorded call, as `GET /v1/episodes/{id}` shows it (prompt messages,
  completion, tool calls, version, return, step rewards, the episode's final reward), with
  `--tokens` the exact prompt/completion token ids and behaviour logprobs.
- `sft`: chat-format rows for supervised fine-tuning elsewhere (TRL's `messages` + `tools`):
  the prompt messages and the completion as the assistant's message. Chat calls that succeeded.
- `pairs`: preference pairs (TRL's conversational `prompt` / `chosen` / `rejected`) from each
  group of calls with the same task, agent and prompt messages: its highest-return completion
  against its lowest, where the returns differ. Credited chat calls that succeeded.

The rows stream from a server-side cursor (`itersize` at a time), so memory does not grow with
the table; Parquet is written a row group at a time. In Parquet the JSON-valued fields (messages,
params, tool calls, rewards) are JSON text; token ids and logprobs are lists. Both load with one
line of Hugging Face `datasets` (README, "Export").
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import text
from sqlalchemy.orm import Session

from core import database
from core.codecs import unpack
from core.tables import PROMPT_IDS_SQL
from core.tenants import OPERATOR, Principal

KINDS = ("transitions", "sft", "pairs")
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
    conditions, params = _conditions(where)
    public = where.principal.public
    if kind == "transitions":
        sql = _TRANSITIONS.format(
            tokens=_TOKEN_COLUMNS if tokens else "", where=" AND ".join(conditions)
        )
        return Query(sql, params, functools.partial(_transition, public=public))
    if kind == "sft":
        conditions += ["t.status = 'ok'", "t.route = 'chat'"]
        sql = _TRANSITIONS.format(tokens="", where=" AND ".join(conditions))
        return Query(sql, params, functools.partial(_sft, public=public))
    conditions += ["t.status = 'ok'", "t.route = 'chat'", 't."return" IS NOT NULL']
    return Query(_PAIRS.format(where=" AND ".join(conditions)), params, _Pairer(public))


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


# A call's prompt messages from its digests, in order (a digest not found is a JSON null), for
# the row aliased `{row}`.
MESSAGES_SQL = """LEFT JOIN LATERAL (
    SELECT coalesce(jsonb_agg(m.body ORDER BY d.ord), '[]') AS messages
    FROM unnest({row}.message_digests) WITH ORDINALITY AS d(digest, ord)
    LEFT JOIN message m ON m.digest = d.digest
) msg"""

# The calls, their messages and the step rewards given to them.
_TRANSITIONS = """
SELECT t.id, t.episode_id, t.task_id, t.agent_name, t.requested_at, t.route, t.status,
       t.model_used, t.policy_version, t.lineage, msg.messages, t.params, t.text, t.tool_calls,
       t.tool_errors, t.finish_reason, t.latency_ms, t.prompt_tokens, t.completion_tokens,
       t.provider, t.cost_usd, t."return", t.credited_at, t.trained_at, t.trained_version,
       e.final_reward, st.step_rewards{tokens}
FROM transition t
JOIN episode e ON e.id = t.episode_id
{messages} ON TRUE
LEFT JOIN LATERAL (
    SELECT jsonb_agg(jsonb_build_object('reward', r.value, 'source', r.source) ORDER BY r.id)
        AS step_rewards
    FROM reward r WHERE r.transition_id = t.id
) st ON TRUE
WHERE {where}
ORDER BY t.requested_at, t.id""".replace("{messages}", MESSAGES_SQL.format(row="t"))
_TOKEN_COLUMNS = (
    f", {PROMPT_IDS_SQL.format(row='t')} AS prompt_token_ids, t.completion_token_ids, t.logprobs"
)


def _transition(r: dict[str, Any], public: Callable[[str], str]) -> dict[str, Any]:
    out = {
        "id": str(r["id"]),
        "episode_id": public(r["episode_id"]),
        "task_id": public(r["task_id"]) if r["task_id"] else None,
        "agent_name": r["agent_name"],
        "requested_at": r["requested_at"].isoformat(),
        "route": r["route"],
        "status": r["status"],
        "model_used": r["model_used"],
        "policy_version": r["policy_version"],
        "lineage": r["lineage"],
        "messages": r["messages"],
        "params": r["params"],
        "text": r["text"],
        "tool_calls": r["tool_calls"],
        "tool_errors": r["tool_errors"],
        "finish_reason": r["finish_reason"],
        "latency_ms": r["latency_ms"],
        "prompt_tokens": r["prompt_tokens"],
        "completion_tokens": r["completion_tokens"],
        "provider": r["provider"],  # a call routed through litellm (no token ids); None: vLLM
        "cost_usd": r["cost_usd"],
        "return": r["return"],
        "step_rewards": r["step_rewards"] or [],
        "final_reward": r["final_reward"],
        "credited_at": r["credited_at"].isoformat() if r["credited_at"] else None,
        "trained_at": r["trained_at"].isoformat() if r["trained_at"] else None,
        "trained_version": r["trained_version"],
    }
    if "logprobs" in r:
        out["prompt_token_ids"] = unpack(r["prompt_token_ids"], "i")
        out["completion_token_ids"] = unpack(r["completion_token_ids"], "i")
        out["logprobs"] = unpack(r["logprobs"], "f")
    return out


def _assistant(text: str | None, tool_calls: list[Any] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text or ""}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _meta(r: dict[str, Any], public: Callable[[str], str]) -> dict[str, Any]:
    return {
        "id": str(r["id"]),
        "episode_id": public(r["episode_id"]),
        "task_id": public(r["task_id"]) if r["task_id"] else None,
        "agent_name": r["agent_name"],
        "policy_version": r["policy_version"],
    }


def _sft(r: dict[str, Any], public: Callable[[str], str]) -> dict[str, Any]:
    return {
        "messages": [*r["messages"], _assistant(r["text"], r["tool_calls"])],
        "tools": (r["params"] or {}).get("tools"),
        **_meta(r, public),
        "return": r["return"],
        "final_reward": r["final_reward"],
    }


# Each group's best and worst completion by return (ties: the earlier call), groups whose
# returns differ; the two rows of a pair come out next to each other, best first.
_PAIRS = """
WITH ranked AS (
    SELECT t.id, t.episode_id, t.task_id, t.agent_name, t.policy_version, t.message_digests,
           t.text, t.tool_calls, t.params, t."return", e.final_reward,
           row_number() OVER (PARTITION BY t.task_id, t.agent_name, t.message_digests
                              ORDER BY t."return" DESC, t.requested_at, t.id) AS best,
           row_number() OVER (PARTITION BY t.task_id, t.agent_name, t.message_digests
                              ORDER BY t."return", t.requested_at, t.id) AS worst,
           max(t."return") OVER g - min(t."return") OVER g AS spread
    FROM transition t JOIN episode e ON e.id = t.episode_id
    WHERE {where}
    WINDOW g AS (PARTITION BY t.task_id, t.agent_name, t.message_digests)
)
SELECT r.*, msg.messages
FROM ranked r
{messages} ON r.best = 1
WHERE (r.best = 1 OR r.worst = 1) AND r.spread > 0
ORDER BY r.task_id, r.agent_name, r.message_digests, r.best""".replace(
    "{messages}", MESSAGES_SQL.format(row="r")
)


class _Pairer:
    """Rows of `_PAIRS` in, pairs out: a group's best row is held until its worst comes."""

    def __init__(self, public: Callable[[str], str]) -> None:
        self._public = public
        self._best: dict[str, Any] | None = None

    def __call__(self, row: dict[str, Any]) -> dict[str, Any] | None:
        if row["best"] == 1:
            self._best = row
            return None
        best = self._best
        if best is None or best["message_digests"] != row["message_digests"]:
            raise RuntimeError("pairs out of order: a group's worst row came without its best")
        return {
            "prompt": best["messages"],
            "chosen": [_assistant(best["text"], best["tool_calls"])],
            "rejected": [_assistant(row["text"], row["tool_calls"])],
            "tools": (best["params"] or {}).get("tools"),
            "task_id": self._public(best["task_id"]) if best["task_id"] else None,
            "agent_name": best["agent_name"],
            "chosen_return": best["return"],
            "rejected_return": row["return"],
            "chosen_id": str(best["id"]),
            "rejected_id": str(row["id"]),
        }


# --- the files ---------------------------------------------------------------------------------


def columns(kind: str, tokens: bool = False) -> list[str]:
    """Each kind's fields, in order (a Parquet file has them even with no rows)."""
    if kind == "transitions":
        return [*_TRANSITION_FIELDS, *(_TOKEN_FIELDS if tokens else ())]
    return _SFT_FIELDS if kind == "sft" else _PAIR_FIELDS


_TRANSITION_FIELDS = [
    "id",
    "episode_id",
    "task_id",
    "agent_name",
    "requested_at",
    "route",
    "status",
    "model_used",
    "policy_version",
    "lineage",
    "messages",
    "params",
    "text",
    "tool_calls",
    "tool_errors",
    "finish_reason",
    "latency_ms",
    "prompt_tokens",
    "completion_tokens",
    "provider",
    "cost_usd",
    "return",
    "step_rewards",
    "final_reward",
    "credited_at",
    "trained_at",
    "trained_version",
]
_TOKEN_FIELDS = ["prompt_token_ids", "completion_token_ids", "logprobs"]
_SFT_FIELDS = [
    "messages",
    "tools",
    "id",
    "episode_id",
    "task_id",
    "agent_name",
    "policy_version",
    "return",
    "final_reward",
]
_PAIR_FIELDS = [
    "prompt",
    "chosen",
    "rejected",
    "tools",
    "task_id",
    "agent_name",
    "chosen_return",
    "rejected_return",
    "chosen_id",
    "rejected_id",
]


def write_jsonl(produced: Iterator[dict[str, Any]], path: Path) -> int:
    count = 0
    with open(path, "wb") as out:
        for row in produced:
            out.write(orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE))
            count += 1
    return count


# Lists of numbers stay lists in Parquet; every other non-scalar value is written as JSON text.
_LIST_COLUMNS = {
    "prompt_token_ids": "int32",
    "completion_token_ids": "int32",
    "logprobs": "float32",
}


def write_parquet(
    produced: Iterator[dict[str, Any]], path: Path, names: list[str], batch: int = BATCH
) -> int:
    import pyarrow as pa  # (here: the CLI's other commands need not load it)
    import pyarrow.parquet as pq

    schema = pa.schema([(name, _parquet_type(pa, name)) for name in names])
    count = 0
    chunk: list[dict[str, Any]] = []
    with open(path, "wb") as out, pq.ParquetWriter(out, schema) as writer:

        def flush() -> None:
            values = {name: [_parquet_value(name, row[name]) for row in chunk] for name in names}
            writer.write_table(pa.Table.from_pydict(values, schema=schema))
            chunk.clear()

        for row in produced:
            chunk.append(row)
            count += 1
            if len(chunk) >= batch:
                flush()
        if chunk or not count:  # no rows: one empty row group, so the file has the columns
            flush()
    return count


def _parquet_value(name: str, value: Any) -> Any:
    if name in _LIST_COLUMNS or value is None or isinstance(value, str | int | float | bool):
        return value
    return orjson.dumps(value).decode()


def _parquet_type(pa: Any, name: str) -> Any:
    """One type per column, the same in every row group (not guessed from the values)."""
    if name in _LIST_COLUMNS:
        return pa.list_(getattr(pa, _LIST_COLUMNS[name])())
    return _SCALAR_TYPES[name](pa) if name in _SCALAR_TYPES else pa.string()


_SCALAR_TYPES: dict[str, Callable[[Any], Any]] = {
    "policy_version": lambda pa: pa.int32(),
    "trained_version": lambda pa: pa.int32(),
    "prompt_tokens": lambda pa: pa.int32(),
    "completion_tokens": lambda pa: pa.int32(),
    "latency_ms": lambda pa: pa.float64(),
    "cost_usd": lambda pa: pa.float64(),
    "return": lambda pa: pa.float64(),
    "final_reward": lambda pa: pa.float64(),
    "chosen_return": lambda pa: pa.float64(),
    "rejected_return": lambda pa: pa.float64(),
}
