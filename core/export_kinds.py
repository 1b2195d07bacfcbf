"""What each kind of export row is: its SQL and its shape (`transitions`, `sft`, `pairs`,
`demonstrations`; see core/export.py), and its fields in order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.codecs import unpack
from core.tables import PROMPT_IDS_SQL

# A call's prompt messages from its digests, in order (a digest not found is a JSON null), for
# the row aliased `{row}`.
MESSAGES_SQL = """LEFT JOIN LATERAL (
    SELECT coalesce(jsonb_agg(m.body ORDER BY d.ord), '[]') AS messages
    FROM unnest({row}.message_digests) WITH ORDINALITY AS d(digest, ord)
    LEFT JOIN message m ON m.digest = d.digest
) msg"""

# The calls, their messages and the step rewards given to them.
TRANSITIONS_SQL = """
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
TOKEN_COLUMNS = (
    f", {PROMPT_IDS_SQL.format(row='t')} AS prompt_token_ids, t.completion_token_ids, t.logprobs"
)


def transition_row(r: dict[str, Any], public: Callable[[str], str]) -> dict[str, Any]:
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


def sft_row(r: dict[str, Any], public: Callable[[str], str]) -> dict[str, Any]:
    return {
        "messages": [*r["messages"], _assistant(r["text"], r["tool_calls"])],
        "tools": (r["params"] or {}).get("tools"),
        **_meta(r, public),
        "return": r["return"],
        "final_reward": r["final_reward"],
    }


# Each group's best and worst completion by return (ties: the earlier call), groups whose
# returns differ; the two rows of a pair come out next to each other, best first.
PAIRS_SQL = """
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


class Pairer:
    """Rows of `PAIRS_SQL` in, pairs out: a group's best row is held until its worst comes."""

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


# Demonstrations: a posted one's prompt and answer; a copied call's from its transition (while
# retention keeps it), its token ids with --tokens either way.
DEMONSTRATIONS_SQL = """
SELECT d.id, d.lineage, d.tenant, d.source, d.episode_id, d.task_id, d.agent_name,
       d.transition_id, coalesce(d.messages, msg.messages) AS messages, d.tools, d.completion,
       t.text, t.tool_calls, d.created_at, d.epochs, d.trained_at, d.trained_version,
       d.skip_reason{tokens}
FROM demonstration d
LEFT JOIN transition t ON t.id = d.transition_id
{messages} ON TRUE
WHERE {where}
ORDER BY d.created_at, d.id""".replace("{messages}", MESSAGES_SQL.format(row="t"))
DEMONSTRATION_TOKEN_COLUMNS = ", d.prompt_token_ids, d.completion_token_ids"


def demonstration_row(r: dict[str, Any], public: Callable[[str], str]) -> dict[str, Any]:
    answer = r["completion"] or _assistant(r["text"], r["tool_calls"])
    out = {
        "messages": [*(r["messages"] or []), answer],  # the prompt, then the answer (TRL's SFT)
        "tools": r["tools"],
        "id": str(r["id"]),
        "lineage": r["lineage"],
        "tenant": r["tenant"],
        "source": r["source"],
        "episode_id": public(r["episode_id"]) if r["episode_id"] else None,
        "task_id": public(r["task_id"]) if r["task_id"] else None,
        "agent_name": r["agent_name"],
        "transition_id": str(r["transition_id"]) if r["transition_id"] else None,
        "created_at": r["created_at"].isoformat(),
        "epochs": r["epochs"],
        "trained_at": r["trained_at"].isoformat() if r["trained_at"] else None,
        "trained_version": r["trained_version"],
        "skip_reason": r["skip_reason"],
    }
    if "completion_token_ids" in r:
        out["prompt_token_ids"] = unpack(r["prompt_token_ids"], "i")
        out["completion_token_ids"] = unpack(r["completion_token_ids"], "i")
    return out


def columns(kind: str, tokens: bool = False) -> list[str]:
    """Each kind's fields, in order (a Parquet file has them even with no rows)."""
    if kind == "transitions":
        return [*_TRANSITION_FIELDS, *(_TOKEN_FIELDS if tokens else ())]
    if kind == "demonstrations":
        return [*_DEMONSTRATION_FIELDS, *(_TOKEN_FIELDS[:2] if tokens else ())]
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
_DEMONSTRATION_FIELDS = [
    "messages",
    "tools",
    "id",
    "lineage",
    "tenant",
    "source",
    "episode_id",
    "task_id",
    "agent_name",
    "transition_id",
    "created_at",
    "epochs",
    "trained_at",
    "trained_version",
    "skip_reason",
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
