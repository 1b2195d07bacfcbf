"""The model of the tool-using task (demo/calc_tools.py). An episode has two model turns
(Hermes-style tool calls, as vLLM's `hermes` parser reads them):

    turn 1  <tool_call>
            {"name": "calculator", "arguments": {"expression": "3 + 4 * 2"}}
            </tool_call>
    tool    11
    turn 2  11

Its model is the tiny Qwen2 of `demo/tiny_model.py`, warm-started on CPU (full-weight supervised,
deterministic) so that it *sometimes* plays the episode right: its first-turn labels are a correct
call only part of the time; the others answer at once with a wrong number, write the expression
unquoted (invalid JSON), call an undeclared tool ("calc"), or use an argument key the schema does
not allow ("expr"); some of its second-turn answers are worded ("The answer is 11."), which the
strict reward rejects. The copying (of the expression into the call, of the result into the
answer) is learnt accurately, so it is the choice of behaviour that limits the reward, and RL has
something real to find. Measured (seed 0, 300 questions sampled at temperature 1, in
`warm_start.json`): turn 1 is a correct call 0.40 of the time, invalid JSON 0.20, a direct answer
0.18, the undeclared tool 0.11, the wrong key 0.09, a wrong expression 0.02 (so the expression is
copied right in 0.96 of well-formed calls); turn 2 after a correct result is right 0.80 of the
time (0.86 bare numbers, 0.93 of those right); expected episode reward 0.33. Prompts: turn 1
203 tokens, its call 26, turn 2 244. Build: about 2 min 15 s on one CPU thread.

The 2-layer model does not find how to copy through a 200-token prompt by itself in that time, so
the warm start begins with a copy curriculum (see COPY_STEPS): random expression tokens repeated
at the question-to-call distance, and short turn-2 "echo" sequences.

    python -m demo.calc_tools_model DIR      # build the model into DIR (idempotent)
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from typing import Any

from demo import warm_start
from demo.calc_tools import (
    INSTRUCTIONS,
    STRICT,
    TOOL_NAME,
    answer,
    evaluate,
    expression,
    messages,
    questions,
    rendered_tools,
    reward,
)
from demo.tiny_model import build_tokenizer, one_build_at_a_time
from demo.warm_start import pad_rows, sample_texts, token_logprobs

WRONG_NAME, WRONG_KEY = "calc", "expr"  # an undeclared tool; a key the schema forbids
WORDY = ["The answer is {}.", "{} is the answer.", "It is {}."]
# First-turn behaviours in the labels; only "call" can earn the reward.
MODES = {"call": 0.5, "direct": 0.2, "bad_json": 0.1, "bad_name": 0.1, "bad_key": 0.1}
P_WORDY = 0.2  # second turn: worded instead of the bare number
TURN2_WEIGHT = 4.0  # loss weight of the turn-2 answer's tokens (turn 1's weigh 1)
STEPS, BATCH, LR, WARMUP = 300, 32, 3e-3, 20
# Copy curriculum: for the first COPY_STEPS steps each batch also holds COPY_BATCH sequences of
# random expression tokens repeated with the period of the question-to-call distance. Without
# them the 2-layer model does not find a copying circuit within the time given (probes, short
# prompts: under 0.2 of the expressions right after 600 steps, digits still mostly wrong after
# 1600); with them it copied all of them within 100 steps.
# And ECHO_BATCH short "echo" sequences: the end of a turn-2 prompt around a random number, then
# that number as the answer (turn 2's copy, which the long prompt otherwise makes slow to find).
COPY_STEPS, COPY_BATCH, COPY_PERIODS, ECHO_BATCH = 150, 16, 3, 32
RECIPE = {
    "steps": STEPS,
    "batch": BATCH,
    "lr": LR,
    "warmup": WARMUP,
    "copy_steps": COPY_STEPS,
    "copy_batch": COPY_BATCH,
    "copy_periods": COPY_PERIODS,
    "echo_batch": ECHO_BATCH,
    "modes": MODES,
    "p_wordy": P_WORDY,
    "turn2_weight": TURN2_WEIGHT,
    "strict": STRICT,
}
EVAL_QUESTIONS = 300
_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def tool_call(name: str, arguments: str) -> str:
    """A turn-1 text in Hermes format (what the template renders for an assistant tool call)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def arguments(expr: str) -> str:
    """The arguments string as vLLM's hermes parser passes it on (json.dumps of the object)."""
    return json.dumps({"expression": expr})


def first_turn(question: str, mode: str) -> str:
    """The turn-1 label text (without the end token) for one of the MODES."""
    expr = expression(question)
    if mode == "call":
        return tool_call(TOOL_NAME, arguments(expr))
    if mode == "bad_json":
        return tool_call(TOOL_NAME, f'{{"expression": {expr}}}')
    if mode == "bad_name":
        return tool_call(WRONG_NAME, arguments(expr))
    if mode == "bad_key":
        return tool_call(TOOL_NAME, json.dumps({WRONG_KEY: expr}))
    a, _, b, _, c = expr.split()
    wrong = int(a) + int(b) + int(c)
    return str(wrong if wrong != answer(question) else wrong + 1)


def history(question: str, result: str, *, expr: str | None = None) -> list[dict[str, Any]]:
    """Turn 2's messages: turn 1 called the tool with `expr` (correct format), it said `result`."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": TOOL_NAME, "arguments": arguments(expr or expression(question))},
    }
    return [
        *messages(question),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
    ]


def parse_call(text: str) -> tuple[str, Any] | None:
    """(name, arguments) of the first tool call in `text` as the hermes parser reads it, or None."""
    match = _TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or "name" not in call:
        return None
    return str(call["name"]), call.get("arguments")


def classify(text: str, question: str) -> str:
    """Which first-turn behaviour `text` shows."""
    if "<tool_call>" not in text:
        return "direct"
    call = parse_call(text)
    if call is None:
        return "bad_json"
    name, args = call
    if name != TOOL_NAME:
        return "bad_name"
    if not isinstance(args, dict) or set(args) != {"expression"}:
        return "bad_key"
    if args["expression"] != expression(question):
        return "wrong_expression"
    return "call" if text == first_turn(question, "call") else "call_other_format"


def tokenizer_corpus() -> tuple[str, ...]:
    """Texts the BPE should merge into few tokens: instructions, tool JSON, calls, answers."""
    tools_json = json.dumps(rendered_tools()[0])
    some = questions()[::97]
    texts = [INSTRUCTIONS, tools_json, "system", "user", "assistant", "tool_response"]
    texts += ["You are provided with function signatures within", "For each function call"]
    texts += ["return a json object with function name and arguments within"]
    texts += [first_turn(q, m) for q in some for m in MODES]
    texts += [w.format(answer(q)) for q in some for w in WORDY]
    return tuple(texts) * 5


@one_build_at_a_time
def build_calc_tools_model(out_dir: Path, *, seed: int = 0) -> Path:
    """Tokenizer (digits as single tokens) + tiny Qwen2, warm-started and measured; idempotent."""
    return warm_start.build(
        Path(out_dir),
        RECIPE,
        seed=seed,
        tokenizer=lambda: build_tokenizer(split_digits=True, extra_corpus=tokenizer_corpus()),
        texts=_Episodes,
        warm_start=_warm_start,
        measure=_measure,
    )


class _Episodes:
    """Token ids of prompts and labels, rendered with the chat template (cached per question)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id
        self.end_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
        self._cache: dict[tuple[str, ...], list[int]] = {}
        first, last = self.prompt(questions()[0]), self.prompt(questions()[-1])
        self.shared = next(i for i, (x, y) in enumerate(zip(first, last, strict=False)) if x != y)
        # The expression's tokens sit at a fixed distance from their copies in turn 1's call.
        call = self.encode(first_turn(questions()[0], "call"))
        in_call = call.index(first[self.shared])
        self.copy_distance = len(first) + in_call - self.shared
        self.copy_alphabet = sorted({t for q in questions()[::7] for t in self.expression_ids(q)})
        # The turn-2 prompt around the tool's result: [<tool_response>, \n] result [\n, ...].
        second = self.second_prompt(questions()[0])
        start = second.index(tokenizer.convert_tokens_to_ids("<tool_response>")) + 2
        self.echo_head = second[start - 2 : start]
        self.echo_tail = second[start + len(self.encode(str(answer(questions()[0])))) - 1 :]

    def render(self, chat: list[dict[str, Any]]) -> list[int]:
        """The prompt as vLLM renders it: the chat template with the tools, generation prompt on."""
        ids = self.tokenizer.apply_chat_template(
            chat,
            tools=rendered_tools(),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        return list(ids)

    def encode(self, text: str) -> list[int]:
        """A completion: the text, then the end token."""
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.eos]

    def echo(self, number: int) -> tuple[list[int], list[float]]:
        """(ids, loss weights): a tool response holding `number`, then `number` as the answer."""
        result = self.encode(str(number))[:-1]
        ids = self.echo_head + result + self.echo_tail
        return ids + result + [self.eos], [0.0] * len(ids) + [1.0] * (len(result) + 1)

    def expression_ids(self, question: str) -> list[int]:
        return list(self.tokenizer.encode(expression(question), add_special_tokens=False))

    def prompt(self, question: str) -> list[int]:
        key = ("prompt", question)
        if key not in self._cache:
            self._cache[key] = self.render(messages(question))
        return self._cache[key]

    def second_prompt(self, question: str) -> list[int]:
        """Turn 2 after the correct call and result; checked to extend turn 1 token for token."""
        key = ("second", question)
        if key not in self._cache:
            ids = self.render(history(question, str(answer(question))))
            turn1 = self.prompt(question) + self.encode(first_turn(question, "call"))
            if ids[: len(turn1)] != turn1:
                raise AssertionError(f"turn 2 does not extend turn 1 for {question!r}")
            self._cache[key] = ids
        return self._cache[key]

    def example(
        self, question: str, mode: str, worded: int | None
    ) -> tuple[list[int], list[float]]:
        """(ids, loss weights) of a supervised episode: turn 1, and turn 2 after a correct call."""
        prompt, label = self.prompt(question), self.encode(first_turn(question, mode))
        if mode != "call":
            return prompt + label, [0.0] * len(prompt) + [1.0] * len(label)
        result = str(answer(question))
        final = self.encode(result if worded is None else WORDY[worded].format(result))
        second = self.second_prompt(question)
        rest = len(second) - len(prompt) - len(label)
        mask = [0.0] * len(prompt) + [1.0] * len(label) + [0.0] * rest
        return second + final, mask + [TURN2_WEIGHT] * len(final)

    def lengths(self) -> dict[str, int]:
        question = "What is 3 + 4 * 2?"
        return {
            "turn1_prompt": len(self.prompt(question)),
            "turn1_label": len(self.encode(first_turn(question, "call"))),
            "turn2_prompt": len(self.second_prompt(question)),
            "turn2_label": len(self.encode("11")),
            "shared_prefix": self.shared,
            "copy_distance": self.copy_distance,
        }


def _warm_start(model: Any, episodes: _Episodes, rng: random.Random) -> None:
    """Supervised on whole episodes whose first turn follows MODES and second turn P_WORDY, with
    the copy curriculum at first."""
    everything = questions()
    modes, weights = list(MODES), list(MODES.values())

    def loss(step: int) -> Any:
        batch = []
        for _ in range(BATCH):
            question = rng.choice(everything)
            mode = rng.choices(modes, weights)[0]
            worded = rng.randrange(len(WORDY)) if rng.random() < P_WORDY else None
            batch.append(episodes.example(question, mode, worded))
        ids, mask = pad_rows(batch, episodes.pad)
        logprobs = token_logprobs(model, ids, episodes.shared)
        total, count = -(logprobs * mask[:, 1:]).sum(), mask.sum()
        if step < COPY_STEPS:
            period = episodes.copy_distance
            copies = []
            for _ in range(COPY_BATCH):
                tokens = [rng.choice(episodes.copy_alphabet) for _ in range(period)]
                marked = [0.0] * period + [1.0] * (period * (COPY_PERIODS - 1))
                copies.append((tokens * COPY_PERIODS, marked))
            echoes = [episodes.echo(rng.randrange(-99, 1000)) for _ in range(ECHO_BATCH)]
            for rows in (copies, echoes):
                ids, mask = pad_rows(rows, episodes.pad)
                logprobs = token_logprobs(model, ids, 0)
                total, count = total - (logprobs * mask[:, 1:]).sum(), count + mask.sum()
        return total / count

    warm_start.train(model, steps=STEPS, lr=LR, warmup=WARMUP, loss=loss)


def _measure(model: Any, episodes: _Episodes, seed: int) -> dict[str, Any]:
    """Sampled behaviour on EVAL_QUESTIONS questions: turn-1 behaviours, turn-2 accuracy after a
    correct tool result, and whole episodes as an agent would play them (tool run on the model's
    own arguments; an undeclared tool or a bad key ends the episode with reward 0)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    sample = random.Random(seed + 1).sample(questions(), EVAL_QUESTIONS)
    firsts = sample_texts(model, episodes, [episodes.prompt(q) for q in sample], generator)
    kinds = [classify(text, q) for text, q in zip(firsts, sample, strict=True)]
    seconds = sample_texts(model, episodes, [episodes.second_prompt(q) for q in sample], generator)
    turn2 = [reward(text, q) for text, q in zip(seconds, sample, strict=True)]

    rewards = [0.0] * len(sample)
    played: dict[int, list[int]] = {}
    for i, (text, q) in enumerate(zip(firsts, sample, strict=True)):
        if kinds[i] == "direct":
            rewards[i] = reward(text, q)
        elif kinds[i] in ("call", "wrong_expression", "call_other_format"):
            _, args = parse_call(text) or ("", {})
            value = evaluate(args["expression"])
            result = "Error: invalid expression" if value is None else str(value)
            played[i] = episodes.render(history(q, result, expr=args["expression"]))
    finals = sample_texts(model, episodes, list(played.values()), generator)
    for i, text in zip(played, finals, strict=True):
        rewards[i] = reward(text, sample[i])
    n = len(sample)
    bare = [bool(re.fullmatch(r"-?\d+", text.strip())) for text in seconds]
    right_format = kinds.count("call") + kinds.count("wrong_expression")
    return {
        "token_lengths": episodes.lengths(),
        "eval_questions": n,
        "turn1": {kind: kinds.count(kind) / n for kind in sorted(set(kinds))},
        "turn1_expression_copied": kinds.count("call") / max(1, right_format),
        "turn2_accuracy_after_correct_result": sum(turn2) / n,
        "turn2_bare_number_rate": sum(bare) / n,
        "turn2_accuracy_when_bare": sum(r for r, b in zip(turn2, bare, strict=True) if b)
        / max(1, sum(bare)),
        "episode_reward": sum(rewards) / n,
        "examples": {"turn1": firsts[:4], "turn2": seconds[:4]},
    }


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".flywheel/calc-tools")
    print(build_calc_tools_model(target))
    print((target / "warm_start.json").read_text())
