"""What BFCL's `multi_turn_base` would ask of SmolLM2-135M here (issue 41's "if time allows"):
the sizes that decide whether the multi-turn loop can run on this model and machine, measured
before building it.

A multi-turn question (200 of them) sets up BFCL's executable environments (a file system, a
trading bot, a travel agency, ...: `involved_classes`), and asks 1-7 user turns; the model
answers each with calls, which are executed and their results fed back, until it answers
without a call. BFCL's prompt for a prompting model is the single-turn one (demo/bfcl.py
`system_prompt`) with every function of the involved classes (`multi_turn_func_doc/`, less the
question's `excluded_function`). This measures, with SmolLM2's own tokenizer and chat template:
each class's function docs in tokens, each question's first prompt (system prompt and first
turn), how many fit the model's context (8,192 positions) with room for an answer, the turns
and ground-truth calls a question has, and what one GRPO group (8 episodes) would hand the
trainer, against the trainer's measured token rate on the single-turn task (the last
`warm-grpo` run of bench/bfcl_learning.jsonl). It starts no server.

    .venv/bin/python -m bench.bfcl_multi_turn   # prints, appends bench/bfcl_multi_turn.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench.common import append_section
from demo import bfcl

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_suffix(".md")
RUNS = ROOT / "bench" / "bfcl_learning.jsonl"
CATEGORY = "multi_turn_base"
GROUP = 8  # samples a question, as the single-turn rounds ask
ANSWER_TOKENS = 128  # room left for an answer, as the single-turn task leaves


def questions(
    docs: dict[str, list[dict[str, Any]]], category: str = CATEGORY
) -> list[dict[str, Any]]:
    """Each question with `functions` filled in from the classes' `docs` as BFCL does for a
    multi-turn entry (utils.py `populate_test_cases_with_predefined_functions`) and its ground
    truth: per turn, the calls."""
    folder = bfcl.data_dir()
    answers = {
        a["id"]: a["ground_truth"]
        for a in _jsonl(folder / "possible_answer" / f"{bfcl.VERSION}_{category}.json")
    }
    entries = _jsonl(folder / f"{bfcl.VERSION}_{category}.json")
    for q in entries:
        excluded = set(q.get("excluded_function", []))
        q["functions"] = [f for c in q["involved_classes"] for f in docs[c]
                          if f["name"] not in excluded]  # fmt: skip
        q["ground_truth"] = answers[q["id"]]
    return entries


def class_docs(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Each environment class's function docs, as BFCL ships them."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    return {c: _jsonl(folder / "multi_turn_func_doc" / f)
            for c, f in MULTI_TURN_FUNC_DOC_FILE_MAPPING.items()}  # fmt: skip


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure(
    tokenizer: Any,
    context: int,
    entries: list[dict[str, Any]],
    docs: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    def tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def first_prompt(q: dict[str, Any]) -> int:
        messages = [{"role": "system", "content": bfcl.system_prompt(q["functions"])},
                    *q["question"][0]]  # fmt: skip
        return tokens(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=False))  # fmt: skip

    classes = sorted({c for q in entries for c in q["involved_classes"]})
    prompts = [first_prompt(q) for q in entries]
    calls = [sum(len(turn) for turn in q["ground_truth"]) for q in entries]
    turns = [len(q["question"]) for q in entries]
    answers = [tokens("[" + ", ".join(turn) + "]") for q in entries for turn in q["ground_truth"]]
    fits = [p for p in prompts if p + ANSWER_TOKENS <= context]
    # The fewest model calls an episode makes: one a ground-truth call (a model may batch a
    # turn's calls in one answer; this counts the turn's answer and the one that ends it,
    # the larger), each reading the prompt so far (never less than the first prompt)
    least = [max(len(q["question"]) * 2, n) for q, n in zip(entries, calls, strict=True)]
    group_tokens = [GROUP * p * n for p, n in zip(prompts, least, strict=True)]
    return {
        "questions": len(entries),
        "held_out": sum(bfcl.held_out(q["id"]) for q in entries),
        "class_doc_tokens": {c: tokens(json.dumps(docs[c], indent=4)) for c in classes},
        "prompt_tokens": _spread(prompts),
        "fit": len(fits),
        "context": context,
        "turns": _spread(turns),
        "calls": _spread(calls),
        "turn_answer_tokens": _spread(answers),
        "least_model_calls": _spread(least),
        "group_tokens": _spread(group_tokens),
    }


def _spread(values: list[int]) -> dict[str, float]:
    ordered = sorted(values)
    return {"min": ordered[0], "median": statistics.median(ordered),
            "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1]}  # fmt: skip


def trainer_rate(runs: Path = RUNS) -> tuple[float, float, str] | None:
    """The last recorded warm-grpo run's trained tokens a second, its seconds a GRPO step, and
    which run it was."""
    for index, line in reversed(list(enumerate(runs.read_text().splitlines(), 1))):
        run = json.loads(line)
        costs = run.get("costs") or {}
        if run["arm"] == "warm-grpo" and costs.get("grpo_trained_tokens"):
            seconds = costs["grpo_train_s"]
            return (costs["grpo_trained_tokens"] / seconds, seconds / costs["grpo_steps"],
                    f"line {index}: seed {run['seed']}, {run['started']}")  # fmt: skip
    return None


ROWS = (
    ("prompt_tokens", "first prompt, tokens (system prompt with the functions + turn 1)"),
    ("turns", "user turns"),
    ("calls", "ground-truth calls"),
    ("turn_answer_tokens", "a turn's ground-truth answer, tokens"),
    ("least_model_calls", "model calls an episode makes, at least"),
    ("group_tokens", f"prompt tokens a group of {GROUP} episodes trains, at least"),
)


def report(m: dict[str, Any], rate: tuple[float, float, str] | None) -> list[str]:
    p, g = m["prompt_tokens"], m["group_tokens"]
    lines = [
        f"{CATEGORY}: {m['questions']} questions ({m['held_out']} held out by the fixed split "
        "rule), SmolLM2-135M-Instruct's tokenizer and chat template.",
        "",
        "| | min | median | p90 | max |",
        "|---|---|---|---|---|",
        *(f"| {name} | {_row(m[key])} |" for key, name in ROWS),
        "",
        "Function docs per class, tokens: "
        + ", ".join(f"{c} {n:,}" for c, n in m["class_doc_tokens"].items())
        + ".",
        f"First prompts that fit the model's {m['context']:,} positions with {ANSWER_TOKENS} "
        f"tokens to answer: {m['fit']} of {m['questions']}; the median prompt is "
        f"{p['median'] / m['context']:.0%} of the context before any turn's history.",
    ]
    if rate is not None:
        per_s, step_s, run = rate
        lines.append(
            f"The trainer trained {per_s:,.0f} tokens/s in the last single-turn warm-grpo run "
            f"({run}; {step_s:.0f} s a GRPO step): one group of {GROUP} multi-turn episodes "
            f"would take at least {g['median'] / per_s / 60:,.0f} minutes to train (median; "
            f"p90 {g['p90'] / per_s / 60:,.0f}), its sequences up to the context's length."
        )
    return lines


def _row(s: dict[str, float]) -> str:
    return " | ".join(f"{s[k]:,.0f}" for k in ("min", "median", "p90", "max"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--runs", type=Path, default=RUNS, help="bench.bfcl_learning's runs")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    from trainer.models import resolve

    model = resolve("smollm2-135m", ROOT / ".flywheel")
    context = AutoConfig.from_pretrained(model).max_position_embeddings
    docs = class_docs(bfcl.data_dir())
    m = measure(AutoTokenizer.from_pretrained(model), context, questions(docs), docs)
    lines = report(m, trainer_rate(args.runs) if args.runs.exists() else None)
    print("\n".join(lines))
    append_section(args.results, "BFCL multi_turn_base sizes", "bench.bfcl_multi_turn", lines)


if __name__ == "__main__":
    main()
