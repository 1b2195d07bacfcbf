"""What an LLM judge is asked and how its answer is read. Pure functions, for both of its uses:

- Rewards (`flywheel judge`, judge/worker.py makes the calls): a task's episodes side by side,
  each scored from 0 to 1 *relative to the others* against a rubric (OpenPipe's RULER: relative
  scores within a group are what GRPO's group advantages need, and a judge ranks far more
  reliably than it grades on an absolute scale).
- Eval sets (the `judge` scorer, trainer/evals.py makes the calls): one answer to an eval item,
  graded alone against the rubric and the item's reference answer if it has one (`grading`).
  Absolute, so that a version's score can be set beside the current version's stored one.

Both answers have one shape, `{"scores": [{"trajectory_id", "explanation", "score"}, ...]}`
(`response_format`, `answer_regex`, `parse`): a grading is a ranking of one.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import orjson

DEFAULT_RUBRIC = """\
- An episode that reaches the goal scores higher than one that does not.
- Among those that reach it, fewer mistakes, wasted steps and invalid tool calls score higher.
- Partial progress toward the goal scores higher than none.
- Use the whole range: the best episode of the group near 1, the worst near 0, unless they are
  equally good or equally bad."""

SYSTEM = """\
You judge the work of an AI agent. Each trajectory below is one episode of the same agent given \
the same task. Score every trajectory from 0 to 1 relative to the others, following the rubric. \
Answer with JSON only: {"scores": [{"trajectory_id": "1", "explanation": "...", "score": 0.0}, \
...]}, one entry per trajectory, in order; each explanation one or two sentences on why."""


@dataclass(frozen=True)
class Call:
    """One recorded call of an episode, as the judge reads it."""

    agent: str | None
    messages: list[Any]  # the prompt's messages, as stored
    text: str | None
    tool_calls: list[Any] | None


@dataclass(frozen=True)
class Score:
    score: float
    explanation: str


class BadAnswer(ValueError):
    """The judge's answer is not the JSON asked for (another attempt may do better)."""


GRADING_RUBRIC = """\
- 1 when the answer does what the question asks, correctly and completely; 0 when it is wrong,
  refuses, or answers something else; in between for an answer partly right.
- With a reference answer: the answer is right when it agrees with the reference in substance
  (wording, order and format may differ unless the question asks for them)."""

GRADING_SYSTEM = """\
You grade one answer of an AI assistant to a question from an evaluation set, on its own, from 0 \
to 1, following the rubric. Answer with JSON only: {"scores": [{"trajectory_id": "1", \
"explanation": "...", "score": 0.0}]}; the explanation one or two sentences on why."""


def rubric_for(task: str | None, rubrics: dict[str, str]) -> str:
    """The first rubric whose pattern matches the task (its public id), else the default."""
    for pattern, rubric in rubrics.items():
        if task is not None and fnmatch.fnmatchcase(task, pattern):
            return rubric
    return rubrics.get("*", DEFAULT_RUBRIC)


def transcript(calls: list[Call], max_chars: int) -> str:
    """An episode as text: the first call's prompt (the task as the agent got it), then each
    call's answer and tool calls, under its agent's name; the middle cut out past `max_chars`."""
    lines = []
    if calls:
        for m in calls[0].messages:
            lines.append(f"[{_role(m)}] {_content(m)}")
    for call in calls:
        who = f"assistant:{call.agent}" if call.agent else "assistant"
        if call.text:
            lines.append(f"[{who}] {call.text}")
        for tc in call.tool_calls or ():
            function = tc.get("function", tc) if isinstance(tc, dict) else {}
            name, arguments = function.get("name"), function.get("arguments")
            lines.append(f"[{who} calls {name}] {arguments}")
    text = "\n".join(lines)
    if len(text) > max_chars:
        half = max_chars // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    return text


def prompt(rubric: str, episodes: list[list[Call]], max_chars: int) -> list[dict[str, str]]:
    body = [f"<rubric>\n{rubric}\n</rubric>"]
    for i, calls in enumerate(episodes, 1):
        body.append(f'<trajectory id="{i}">\n{transcript(calls, max_chars)}\n</trajectory>')
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n\n".join(body)}]


def grading(
    messages: list[Any],
    answer: dict[str, Any],
    *,
    rubric: str | None,
    reference: Any,
    max_chars: int,
) -> list[dict[str, str]]:
    """The judge's prompt for one eval item (`messages`, the prompt the model was asked) and the
    model's `answer` (the assistant message: content, tool_calls); `reference` (a string or a
    list of accepted ones) shown when the item has one."""
    calls = [Call(None, messages, answer.get("content"), answer.get("tool_calls"))]
    body = [f"<rubric>\n{rubric or GRADING_RUBRIC}\n</rubric>"]
    if reference is not None:
        accepted = reference if isinstance(reference, list) else [reference]
        shown = "\n".join(r if isinstance(r, str) else orjson.dumps(r).decode() for r in accepted)
        body.append(f"<reference>\n{shown}\n</reference>")
    body.append(f'<trajectory id="1">\n{transcript(calls, max_chars)}\n</trajectory>')
    return [
        {"role": "system", "content": GRADING_SYSTEM},
        {"role": "user", "content": "\n\n".join(body)},
    ]


def response_format(kind: str, n: int) -> dict[str, Any] | None:
    """The answer's shape for the provider: a JSON schema (exactly `n` scores), JSON mode, or
    nothing (the prompt alone asks for it)."""
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        return None
    entry = {
        "type": "object",
        "properties": {
            "trajectory_id": {"type": "string"},
            "explanation": {"type": "string"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["trajectory_id", "explanation", "score"],
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": entry, "minItems": n, "maxItems": n}},
        "required": ["scores"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "scores", "schema": schema}}


def answer_regex(n: int, explanation_chars: int = 200) -> str:
    """The compact answer for `n` trajectories, exactly (vLLM's `structured_outputs.regex`):
    ids in order, a short plain explanation, a score in [0, 1] with at most three decimals."""
    score = r"(0(\.[0-9]{1,3})?|1(\.0{1,3})?)"
    explanation = rf"[A-Za-z0-9 ,.;:'()+*/=-]{{0,{explanation_chars}}}"
    entries = ",".join(
        rf'\{{"trajectory_id":"{i}","explanation":"{explanation}","score":{score}\}}'
        for i in range(1, n + 1)
    )
    return rf'\{{"scores":\[{entries}\]\}}'


def parse(answer: str | None, n: int) -> list[Score]:
    """The `n` scores, in trajectory order; BadAnswer unless every trajectory has exactly one
    score in [0, 1]. A fenced ```json block is accepted (models add them)."""
    text = (answer or "").strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    try:
        scores = orjson.loads(text)["scores"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        raise BadAnswer(f"not the JSON asked for: {text[:200]!r}") from e
    if not isinstance(scores, list):
        raise BadAnswer("`scores` is not a list")
    by_id: dict[str, Score] = {}
    for entry in scores:
        try:
            key, value = str(entry["trajectory_id"]), entry["score"]
            explanation = str(entry.get("explanation", ""))
        except (KeyError, TypeError) as e:
            raise BadAnswer(f"a score without trajectory_id or score: {entry!r}") from e
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise BadAnswer(f"trajectory {key}: score {value!r} is not a number in [0, 1]")
        if key in by_id:
            raise BadAnswer(f"trajectory {key} scored twice")
        by_id[key] = Score(float(value), explanation)
    wanted = [str(i) for i in range(1, n + 1)]
    if sorted(by_id) != sorted(wanted):
        raise BadAnswer(f"scores for {sorted(by_id)}, wanted {wanted}")
    return [by_id[k] for k in wanted]


def _role(message: Any) -> str:
    return str(message.get("role", "?")) if isinstance(message, dict) else "?"


def _content(message: Any) -> str:
    if not isinstance(message, dict):
        return str(message)
    content = message.get("content")
    if isinstance(content, list):  # parts
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)
