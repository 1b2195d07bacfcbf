"""Scoring recorded completions in passes (trainer/learner/scoring.py): however the rows are cut
into passes, each row gets the log-probability it gets alone, in the order it was given."""

from __future__ import annotations

import random

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from demo.tiny_model import build_demo_model
from tests.conftest import TEST_HOME
from trainer.data.sampling import Sampling
from trainer.learner import scoring
from trainer.learner.scoring import Completion, completion_logprobs
from trainer.models import LORA_TARGETS


def rows() -> list[Completion]:
    """Prompts of many lengths, some repeated (a group's samples), completions of 1-9 tokens,
    two sampling settings."""
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 120) for _ in range(rng.randint(3, 40))] for _ in range(9)]
    return [
        Completion(
            rng.choice(prompts),
            [rng.randrange(5, 120) for _ in range(rng.randint(1, 9))],
            Sampling(temperature=rng.choice([1.0, 0.7]), top_p=rng.choice([1.0, 0.9])),
        )
        for _ in range(30)
    ]


@pytest.mark.parametrize("share", [True, False])
def test_any_cut_into_passes_gives_each_row_its_own_logprob_in_order(share: bool) -> None:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(
        build_demo_model(TEST_HOME / "models" / "demo"), dtype=torch.float32
    )
    model = get_peft_model(
        base, LoraConfig(r=8, target_modules=LORA_TARGETS["qwen2"], init_lora_weights=False)
    )
    cpu, given = torch.device("cpu"), rows()
    alone = [completion_logprobs(model, [r], pad_id=0, device=cpu, share=share)[0] for r in given]
    for budget in (0, 1, 60, 400, 100_000):  # 0: the default; 1: a row a pass
        got = completion_logprobs(
            model, given, pad_id=0, device=cpu, share=share, pass_tokens=budget
        )
        assert got == pytest.approx(alone, abs=1e-4), budget
    assert len(set(alone)) == len(alone)  # a row's value in another row's place would show


def test_passes_keep_to_the_budget_and_take_short_rows_many_at_once() -> None:
    given = rows()
    order = sorted(range(len(given)), key=lambda i: scoring._length(given[i]), reverse=True)

    def padded(piece: list[int]) -> int:
        return len(piece) * (
            max(len(given[i].prompt_ids) for i in piece)
            + max(len(given[i].completion_ids) for i in piece)
        )

    for budget in (60, 400):
        pieces = scoring._pieces(order, given, budget)
        assert sorted(i for p in pieces for i in p) == list(range(len(given)))
        assert all(len(p) == 1 or padded(p) <= budget for p in pieces), budget
    # No budget set: the whole window of short calls in one pass (there were 8 rows a pass).
    assert [len(p) for p in scoring._pieces(order, given, 0)] == [len(given)]
