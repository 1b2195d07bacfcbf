"""A multi-turn, tool-using task shaped like Calc-X: "What is 3 + 4 * 2?" (digits 1..9, operators
+ - * with the usual precedence), answered by calling a `calculator` function tool and then giving
the number only. Reward 1 when the final answer is exactly the integer, else 0.

The agent that plays it is demo/tool_agent.py (the OpenAI Agents SDK with this module's tool and
calculator); its warm-started model is built by demo/calc_tools_model.py.
"""

from __future__ import annotations

import re
from typing import Any

INSTRUCTIONS = "Use the calculator tool, then answer with the number only."
TOOL_NAME = "calculator"
TOOL_DESCRIPTION = "Evaluate an arithmetic expression and return the result."
TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "expression": {
            "type": "string",
            "description": "The arithmetic expression to evaluate.",
        }
    },
    "required": ["expression"],
    "additionalProperties": False,
}
# Not strict: with `strict: true` vLLM constrains decoding to the tool's schema once a call
# starts (its structural tags), so the model could not make the mistakes it is here to unlearn,
# and the logprobs it is trained with would be those of the constrained distribution.
STRICT = False
OPS = "+-*"
DIGITS = range(1, 10)
_QUESTION = re.compile(r"What is (\d) ([-+*]) (\d) ([-+*]) (\d)\?")
_EXPRESSION = re.compile(r"(\d) ([-+*]) (\d) ([-+*]) (\d)")


def questions() -> list[str]:
    """All 6561 questions, in a fixed order."""
    return [
        f"What is {a} {p} {b} {q} {c}?"
        for a in DIGITS
        for p in OPS
        for b in DIGITS
        for q in OPS
        for c in DIGITS
    ]


def expression(question: str) -> str:
    """ "What is 3 + 4 * 2?" -> "3 + 4 * 2"."""
    match = _QUESTION.fullmatch(question)
    if match is None:
        raise ValueError(f"not a question of this task: {question!r}")
    return " ".join(match.groups())


def task_id(question: str) -> str:
    """ "What is 3 + 4 * 2?" -> "calc-3+4x2" (tag-safe: no spaces, no '*')."""
    return "calc-" + expression(question).replace(" ", "").replace("*", "x")


def evaluate(expr: str) -> int | None:
    """The calculator: "d op d op d" (single digits, + - *, spaces as shown), else None."""
    match = _EXPRESSION.fullmatch(expr)
    if match is None:
        return None
    a, p, b, q, c = match.groups()
    terms, signs = [int(a)], [1]
    for op, digit in ((p, int(b)), (q, int(c))):
        if op == "*":
            terms[-1] *= digit
        else:
            terms.append(digit)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def answer(question: str) -> int:
    result = evaluate(expression(question))
    assert result is not None
    return result


def reward(final_text: str, question: str) -> float:
    return 1.0 if final_text.strip() == str(answer(question)) else 0.0


def rendered_tools() -> list[dict[str, Any]]:
    """The tools as the chat template receives them from vLLM's Responses API.

    vLLM turns the Agents SDK's function tool (`strict: false`, STRICT) into
    `ChatCompletionToolsParam(type="function", function=FunctionDefinition(...)).model_dump()`
    (`construct_tool_dicts` in vllm/entrypoints/openai/responses/utils.py); key order and the
    `strict` flag matter, as the template renders the dict with `tojson`.
    tests/demo/test_calc_tools.py
    checks this dict against vLLM's own classes.
    """
    function = {
        "name": TOOL_NAME,
        "description": TOOL_DESCRIPTION,
        "parameters": TOOL_PARAMETERS,
        "strict": STRICT,
    }
    return [{"type": "function", "function": function}]


def messages(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}]
