"""Eval sets: prompts each new version of a lineage is asked at temperature 0 before it serves
(trainer/evals.py asks and scores them; the promotion gate, trainer/gate.py, compares the scores
with the current version's). Made by `flywheel eval add` from a JSONL file of items or from a
`flywheel export` file; stored one row a set (`eval_set`, core/tables.py).

An item, one JSON object a line:

    {"messages": [{"role": "user", "content": "2+2?"}], "reference": "4"}
    {"prompt": "2+2?", "reference": ["4", "four"]}          # one user message
    {"messages": [..., {"role": "assistant", "content": "4"}]}   # the last answer: the reference
    a `flywheel export --kind transitions` row                 # its prompt, its answer (`text`)
    optional: "tools" (the request's), "max_tokens" (the answer's bound), "rubric" (what the
    `judge` scorer grades this item by)

Scorers (`scorer`):

    exact                   1 when the answer's text, stripped, is the reference (or one of a
                            list of them), else 0
    python:module:function  function(answer, item) -> float: `answer` is the assistant message
                            ({"content": ..., "tool_calls": [...] or None}), `item` the item
                            ({"messages", "tools", "reference", "max_tokens", "rubric"});
                            imported from the trainer's environment
    judge                   an LLM judge grades each answer from 0 to 1 against the item's
                            rubric (or a default one) and its reference if it has one
                            (core/ruler.py `grading`); the trainer calls the judge model
                            named by FLYWHEEL_EVAL_JUDGE_MODEL at FLYWHEEL_EVAL_JUDGE_URL

A set's score is the mean over its items. The SQL functions take a sync session and leave the
transaction to their caller.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from core.naming import LINEAGE_NAME
from core.tables import EvalSet as EvalSetRow

MAX_ITEMS = 10_000
MAX_TOKENS = 32_768
ROLES = {"system", "developer", "user", "assistant", "tool"}
Scorer = Callable[[dict[str, Any], dict[str, Any]], float]


class BadEvalSet(ValueError):
    """An eval set or one of its items is not what it must be: the message says where."""


@dataclass(frozen=True)
class EvalSet:
    id: int
    lineage: str
    name: str
    scorer: str
    items: list[dict[str, Any]]
    digest: str
    source: str


def item_from(row: Any, where: str) -> dict[str, Any]:
    """One item from a JSONL row in any of the shapes above; BadEvalSet names `where`."""
    if not isinstance(row, dict):
        raise BadEvalSet(f"{where}: an item is a JSON object, not {type(row).__name__}")
    messages = row.get("messages")
    if messages is None and isinstance(row.get("prompt"), str):
        messages = [{"role": "user", "content": row["prompt"]}]
    if not isinstance(messages, list) or not messages:
        raise BadEvalSet(f"{where}: no `messages` (a non-empty list) and no `prompt` (a string)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadEvalSet(f"{where}: message {i} is not a chat message with a known role")
    reference = row.get("reference")
    if "reference" not in row:
        if "text" in row and messages[-1].get("role") != "assistant":  # an export's call
            reference = row["text"]
        elif messages[-1].get("role") == "assistant":  # an sft export row, a demonstration
            reference = messages[-1].get("content")
            messages = messages[:-1]
    if not messages or messages[-1].get("role") == "assistant":
        raise BadEvalSet(f"{where}: the prompt ends with an assistant message")
    tools = row.get("tools")
    if tools is None and isinstance(row.get("params"), dict):
        tools = row["params"].get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadEvalSet(f"{where}: `tools` is a list")
    max_tokens = row.get("max_tokens")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not max_tokens > 0
    ):
        raise BadEvalSet(f"{where}: `max_tokens` is a positive integer")
    if max_tokens is not None and max_tokens > MAX_TOKENS:
        raise BadEvalSet(f"{where}: `max_tokens` is at most {MAX_TOKENS}")
    rubric = row.get("rubric")
    if rubric is not None and not (isinstance(rubric, str) and rubric.strip()):
        raise BadEvalSet(f"{where}: `rubric` is a non-empty string")
    item = {"messages": messages, "tools": tools, "reference": reference, "max_tokens": max_tokens}
    if rubric is not None:  # absent, not null: the digest of every set made before stays the same
        item["rubric"] = rubric
    return item


def read_items(lines: Iterable[bytes | str], source: str) -> list[dict[str, Any]]:
    """Every item of a JSONL file (blank lines skipped); BadEvalSet names the line."""
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise BadEvalSet(f"{source}:{n}: not JSON ({e})") from None
        items.append(item_from(row, f"{source}:{n}"))
        if len(items) > MAX_ITEMS:
            raise BadEvalSet(f"{source}: more than {MAX_ITEMS} items; an eval set is a sample")
    if not items:
        raise BadEvalSet(f"{source}: no items")
    return items


JUDGE = "judge"  # the LLM-judge scorer: graded by a model (trainer/evals.py), not a function


def scorer(spec: str) -> Scorer:
    """The function a scorer spec names, imported; BadEvalSet if it cannot be (`judge` is not a
    function: trainer/evals.py grades through the judge model)."""
    if spec == "exact":
        return exact
    kind, _, path = spec.partition(":")
    module_name, _, function_name = path.partition(":")
    if kind != "python" or not module_name or not function_name:
        raise BadEvalSet(f"scorer {spec!r}: `exact`, `judge` or `python:module:function`")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BadEvalSet(f"scorer {spec!r}: cannot import {module_name}: {e}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise BadEvalSet(f"scorer {spec!r}: {module_name} has no function {function_name}")
    return function  # type: ignore[no-any-return]


def exact(answer: dict[str, Any], item: dict[str, Any]) -> float:
    reference = item["reference"]
    references = reference if isinstance(reference, list) else [reference]
    text = (answer.get("content") or "").strip()
    return float(any(isinstance(r, str) and text == r.strip() for r in references))


def check(scorer_spec: str, items: list[dict[str, Any]]) -> None:
    """What the scorer needs of every item: `exact` a string reference (or a list of them)."""
    if scorer_spec == JUDGE:
        return  # a reference helps the judge; the rubric alone is enough
    scorer(scorer_spec)
    if scorer_spec != "exact":
        return
    for i, item in enumerate(items):
        r = item["reference"]
        if not (
            isinstance(r, str) or (isinstance(r, list) and r and all(isinstance(x, str) for x in r))
        ):
            raise BadEvalSet(f"item {i}: the exact scorer needs a string reference (or a list)")


def digest(scorer_spec: str, items: list[dict[str, Any]]) -> str:
    body = orjson.dumps({"scorer": scorer_spec, "items": items}, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(body, digest_size=8).hexdigest()


# --- storage: the caller owns the transaction ------------------------------------------------


def add(
    *,
    session: Session,
    lineage: str,
    name: str,
    scorer_spec: str,
    items: list[dict[str, Any]],
    source: str,
    replace: bool = False,
) -> EvalSet:
    """Store a set (checked first); an existing name is an error unless `replace`."""
    if not LINEAGE_NAME.fullmatch(lineage):
        raise BadEvalSet(f"{lineage!r} is not a lineage name")
    if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").isalnum():
        raise BadEvalSet(f"{name!r}: an eval set's name is letters, digits, - and _ (64 at most)")
    check(scorer_spec, items)
    values: dict[str, Any] = {
        "lineage": lineage,
        "name": name,
        "scorer": scorer_spec,
        "items": items,
        "digest": digest(scorer_spec, items),
        "source": source,
    }
    statement = insert(EvalSetRow).values(**values)
    if replace:
        statement = statement.on_conflict_do_update(index_elements=["lineage", "name"], set_=values)
    else:
        statement = statement.on_conflict_do_nothing(index_elements=["lineage", "name"])
    id_ = session.execute(statement.returning(EvalSetRow.id)).scalar_one_or_none()
    if id_ is None:
        raise BadEvalSet(f"{lineage} already has an eval set {name!r} (--replace replaces it)")
    return EvalSet(id_, lineage, name, scorer_spec, items, values["digest"], source)


def sets(*, session: Session, lineage: str | None = None) -> list[EvalSet]:
    """A lineage's eval sets (every lineage's: None), by lineage and name."""
    query = select(EvalSetRow).order_by(EvalSetRow.lineage, EvalSetRow.name)
    if lineage is not None:
        query = query.where(EvalSetRow.lineage == lineage)
    return [
        EvalSet(r.id, r.lineage, r.name, r.scorer, r.items, r.digest, r.source)
        for r in session.scalars(query)
    ]


def remove(*, session: Session, lineage: str, name: str) -> bool:
    gone = session.execute(
        delete(EvalSetRow)
        .where(EvalSetRow.lineage == lineage, EvalSetRow.name == name)
        .returning(EvalSetRow.id)
    ).first()
    return gone is not None
