"""The demo task, shaped like Agent Lightning's calculator task: "What is a + b?" (a, b in 0..9),
reward 1 when the answer is exactly the number, else 0.

Its model is the tiny Qwen2 of `demo/tiny_model.py`, warm-started in about 45 s on CPU (full-weight
supervised, deterministic) so that it *half* solves the task: it knows the sums but, as its labels
did 60% of the time, often answers in words ("The answer is 7.") that the strict reward rejects.
RL with LoRA then has something real to find: answering with the bare number. On a randomly
initialised model of this size LoRA barely learns (see shared facts); on this one it lifts the
sampled accuracy from about 0.37 to about 0.85 in 40 GRPO steps (in-process probes).

    python -m demo.calculator DIR      # build the model into DIR (idempotent)
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path
from typing import Any

from demo import warm_start
from demo.tiny_model import build_tokenizer, one_build_at_a_time

SYSTEM = "Answer with a single number."
QUESTIONS = [(a, b) for a in range(10) for b in range(10)]
WORDY = ["The answer is {}.", "{} is the answer.", "It is {}."]
STEPS, BATCH, LR, WARMUP, P_WORDY = 400, 64, 3e-3, 20, 0.6
RECIPE = {"steps": STEPS, "batch": BATCH, "lr": LR, "warmup": WARMUP, "p_wordy": P_WORDY}


def messages(a: int, b: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]


def task_id(a: int, b: int) -> str:
    return f"add-{a}-{b}"


def reward(answer: str, a: int, b: int) -> float:
    try:
        return 1.0 if int(answer.strip()) == a + b else 0.0
    except ValueError:
        return 0.0


def worded_reward(answer: str, a: int, b: int) -> float:
    """The opposite taste (a second tenant's, tests/e2e/test_e2e_tenants.py): 1 for the right sum
    said in words ("The answer is 7."), 0 for the bare number or a wrong one."""
    numbers = re.findall(r"\d+", answer)
    return 1.0 if numbers == [str(a + b)] and answer.strip() != numbers[0] else 0.0


@one_build_at_a_time
def build_calculator_model(out_dir: Path, *, seed: int = 0) -> Path:
    """Tokenizer (digits as single tokens) + tiny Qwen2, warm-started; idempotent."""
    return warm_start.build(
        Path(out_dir),
        RECIPE,
        seed=seed,
        tokenizer=lambda: build_tokenizer(
            split_digits=True, extra_corpus=(SYSTEM, "system", "user", "assistant") * 3
        ),
        texts=_Texts,
        warm_start=_warm_start,
        measure=_measure,
    )


class _Texts:
    """Every question's prompt, and every answer bare or worded, as token ids."""

    def __init__(self, tokenizer: Any) -> None:
        import torch

        def encode(text: str) -> list[int]:
            return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]

        self.prompts = torch.tensor(
            [
                tokenizer.apply_chat_template(
                    messages(a, b), add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
                for a, b in QUESTIONS
            ]
        )  # digits are single tokens, so every prompt has the same length
        self.bare = {n: encode(str(n)) for n in range(19)}
        self.wordy = {(n, k): encode(w.format(n)) for n in range(19) for k, w in enumerate(WORDY)}
        self.width = max(map(len, [*self.bare.values(), *self.wordy.values()]))
        self.pad = tokenizer.pad_token_id

    def completions(self, labels: list[list[int]]) -> tuple[Any, Any]:
        """(ids, loss mask), right-padded to the longest answer."""
        import torch

        ids = torch.tensor([x + [self.pad] * (self.width - len(x)) for x in labels])
        mask = torch.tensor([[1.0] * len(x) + [0.0] * (self.width - len(x)) for x in labels])
        return ids, mask


def _warm_start(model: Any, texts: _Texts, rng: random.Random) -> None:
    """Supervised on correct sums, 60% of them worded."""

    def loss(_step: int) -> Any:
        rows = [rng.randrange(len(QUESTIONS)) for _ in range(BATCH)]
        labels = []
        for i in rows:
            total = sum(QUESTIONS[i])
            worded = rng.random() < P_WORDY
            labels.append(
                texts.wordy[(total, rng.randrange(len(WORDY)))] if worded else texts.bare[total]
            )
        completion, mask = texts.completions(labels)
        return -(_logprobs(model, texts.prompts[rows], completion) * mask).sum() / mask.sum()

    warm_start.train(model, steps=STEPS, lr=LR, warmup=WARMUP, loss=loss)


def _measure(model: Any, texts: _Texts, _seed: int) -> dict[str, Any]:
    """Expected accuracy at temperature 1: P(exactly the bare number, then the end token)."""
    import torch

    completion, mask = texts.completions([texts.bare[a + b] for a, b in QUESTIONS])
    with torch.no_grad():
        p = ((_logprobs(model, texts.prompts, completion) * mask).sum(1)).exp()
    return {"exact_accuracy": float(p.mean())}


def _logprobs(model: Any, prompts: Any, completion: Any) -> Any:
    import torch

    ids = torch.cat([prompts, completion], 1)
    logits = model(input_ids=ids).logits[:, prompts.shape[1] - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, completion[..., None]).squeeze(-1)


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".flywheel/calc")
    print(build_calculator_model(target))
    print((target / "warm_start.json").read_text())
