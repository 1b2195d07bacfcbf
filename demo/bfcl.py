"""The Berkeley Function Calling Leaderboard (BFCL v4) as a Flywheel task: its questions, its
prompt for models without native tool calling, its answers as rewards, one fixed split.

The data is the PyPI package `bfcl-eval` (installed without its dependencies by `make install`:
they pin numpy 1.26 and a dozen provider SDKs; nothing here needs them), read from its folder
without importing its code, except its prompt constants (`bfcl_eval.constants.default_prompts`,
a module of plain strings). The checker is ours (demo/bfcl_check.py), cross-checked against the
official one (tests/demo/test_bfcl_check.py).

    questions = load("simple_python")
    train, held_out = split(questions)
    messages = prompt(q)              # BFCL's system prompt (functions as JSON) + the question
    verdict = q.score(answer_text)    # .valid (BFCL's verdict), .parsable, .partial

The split is fixed and made once: a question is held out when the BLAKE2b digest of its id is
0 modulo 4 (about a quarter). Held-out questions are never trained on and never used to choose
settings; demonstrations come only from the training part.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from demo.bfcl_check import Verdict, score

PACKAGE = "bfcl_eval"
VERSION = "BFCL_v4"
HELD_OUT_MODULUS = 4  # a question is held out when digest(id) % 4 == 0
# BFCL's default prompt configuration (constants/default_prompts.py DEFAULT_SYSTEM_PROMPT_FORMAT):
# answers as Python calls, no <TOOLCALL> tag, functions as JSON, plain text, the classic style.
RETURN_FORMAT, DOC_FORMAT, STYLE = "python", "json", "classic"


class BfclMissing(RuntimeError):
    """The bfcl-eval package is not installed."""


@dataclass(frozen=True)
class Question:
    id: str
    category: str
    messages: list[dict[str, str]]  # the question's turn (BFCL's first turn)
    functions: list[dict[str, Any]]
    possible: list[Any]  # BFCL's ground truth: per call, per parameter, the accepted values

    def score(self, text: str) -> Verdict:
        return score(text, self.functions, self.possible, self.category)

    @property
    def held_out(self) -> bool:
        return held_out(self.id)


def held_out(question_id: str) -> bool:
    """The fixed split rule of the module's docstring, for any BFCL question id."""
    digest = hashlib.blake2b(question_id.encode()).digest()[:8]
    return int.from_bytes(digest) % HELD_OUT_MODULUS == 0


def data_dir() -> Path:
    """The package's data folder (found without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BfclMissing(
            "BFCL's data is the PyPI package bfcl-eval: `make install` installs it, or "
            "pip install --no-deps bfcl-eval==2026.3.23"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


@cache
def load(category: str = "simple_python") -> tuple[Question, ...]:
    """Every question of a single-turn category with its possible answers, in BFCL's order."""
    folder = data_dir()
    questions = _jsonl(folder / f"{VERSION}_{category}.json")
    answers = {
        a["id"]: a["ground_truth"]
        for a in _jsonl(folder / "possible_answer" / f"{VERSION}_{category}.json")
    }
    return tuple(
        Question(q["id"], category, q["question"][0], q["function"], answers[q["id"]])
        for q in questions
    )


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def split(questions: tuple[Question, ...]) -> tuple[list[Question], list[Question]]:
    """(training part, held-out part), by the fixed rule of the module's docstring."""
    return [q for q in questions if not q.held_out], [q for q in questions if q.held_out]


def system_prompt(functions: list[dict[str, Any]]) -> str:
    """BFCL's default system prompt for prompting models (model_handler/utils.py
    `formulate_system_prompt`), from the package's own strings."""
    from bfcl_eval.constants import default_prompts as p

    style = p.PROMPT_STYLE_TEMPLATES[STYLE]
    template: str = p.PROMPT_TEMPLATE_MAPPING["plaintext"]
    return template.format(
        persona=style["persona"],
        task=style["task"],
        tool_call_format=style["tool_call_no_tag"].format(
            output_format=p.OUTPUT_FORMAT_MAPPING[RETURN_FORMAT],
            param_types=p.PARAM_TYPE_MAPPING[RETURN_FORMAT],
        ),
        multiturn_behavior=style["multiturn_behavior"],
        available_tools=style["available_tools"].format(
            format=DOC_FORMAT, functions=json.dumps(functions, indent=4)
        ),
    )


def prompt(q: Question) -> list[dict[str, str]]:
    """The chat messages BFCL sends a prompting model: its system prompt first (a question's own
    system message, if any, follows it in the same message, as BFCL does)."""
    messages = [dict(m) for m in q.messages]
    system = system_prompt(q.functions)
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = system + "\n\n" + messages[0]["content"]
        return messages
    return [{"role": "system", "content": system}, *messages]


def demonstration(q: Question) -> str:
    """A correct answer written as BFCL asks for one, `[f(a=1, b='x')]`, from the possible
    answers: each parameter's first accepted value; an optional one ("" accepted) left out."""
    calls = []
    for call in q.possible:
        ((name, params),) = call.items()
        function = next(f for f in q.functions if f["name"] == name)
        required = function["parameters"]["required"]
        args = [
            f"{k}={_chosen(values)!r}"
            for k, values in params.items()
            if k in required or "" not in values
        ]
        calls.append(f"{name}({', '.join(args)})")
    return f"[{', '.join(calls)}]"


def _chosen(values: list[Any]) -> Any:
    """The first accepted value; a dict in BFCL's answers holds accepted values per key. A
    required parameter whose only accepted value is "" (a few live questions) gets ""."""
    value = next((v for v in values if v != ""), "")
    return _resolved(value)


def _resolved(value: Any) -> Any:
    if isinstance(value, dict):
        return {  # (a few live answers give a nested dict's values bare, not as lists)
            k: _chosen(v) if isinstance(v, list) else v
            for k, v in value.items()
            if not isinstance(v, list) or "" not in v
        }
    if isinstance(value, list):
        return [_resolved(v) for v in value]
    return value


# --- as an eval set (core/evals.py): the promotion gate's second witness --------------------


def eval_item(q: Question, max_tokens: int = 128) -> dict[str, Any]:
    """A question as an eval-set item: BFCL's prompt, and what the AST check needs to score an
    answer as the reference."""
    reference = {"id": q.id, "category": q.category, "functions": q.functions,
                 "possible": q.possible}  # fmt: skip
    return {"messages": prompt(q), "tools": None, "reference": reference, "max_tokens": max_tokens}


def spread(questions: list[Question], n: int) -> list[Question]:
    """N of `questions` spread over them (every k-th): an eval set's sample."""
    return questions[:: max(1, len(questions) // n)][:n]


def eval_score(answer: dict[str, Any], item: dict[str, Any]) -> float:
    """The eval set's scorer (`flywheel eval add ... --scorer python:demo.bfcl:eval_score`): 1
    for a valid call by BFCL's AST check, else 0."""
    r = item["reference"]
    verdict = score(answer.get("content") or "", r["functions"], r["possible"], r["category"])
    return 1.0 if verdict.valid else 0.0


def main() -> None:
    """`python -m demo.bfcl eval-set OUT.jsonl [--questions N]`: an eval set of the training
    part's questions (every k-th, never a held-out one), for `flywheel eval add`."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("action", choices=["eval-set"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--category", default="simple_python")
    args = parser.parse_args()
    train, _ = split(load(args.category))
    chosen = spread(train, args.questions)
    args.out.write_text("".join(json.dumps(eval_item(q)) + "\n" for q in chosen))
    print(
        f"{len(chosen)} training-part questions of {args.category} in {args.out}: flywheel eval "
        f"add bfcl --lineage policy --from {args.out} --scorer python:demo.bfcl:eval_score"
    )


if __name__ == "__main__":
    main()
