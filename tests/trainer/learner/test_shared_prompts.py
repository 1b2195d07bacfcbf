"""Rows sharing a prompt forward it once (trainer/learner/shared_prompts.py): the same logits and
the same LoRA gradients as forwarding every row whole."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from demo.tiny_model import build_demo_model
from tests.conftest import TEST_HOME
from trainer.learner.shared_prompts import Plan, completion_logits
from trainer.models import LORA_TARGETS

PAD = 0


def batch(
    preamble: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], int]:
    """As TRL pads a batch: prompts left-padded, completions right-padded. Three rows on one
    prompt, two on another, one alone; all after `preamble`, if given (a system prompt)."""
    prompt_a, prompt_b, prompt_c = list(range(5, 25)), list(range(30, 37)), [60, 61, 62]
    if preamble is not None:
        prompt_a, prompt_b, prompt_c = (preamble + p for p in (prompt_a, prompt_b, prompt_c))
    rows = [
        (prompt_a, [70, 71, 72, 73]),
        (prompt_b, [80, 81]),
        (prompt_a, [74, 75]),
        (prompt_c, [90, 91, 92]),
        (prompt_a, [76, 77, 78, 79]),
        (prompt_b, [82, 83, 84]),
    ]
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    ids, mask = [], []
    for p, c in rows:
        left, right = width_p - len(p), width_c - len(c)
        ids.append([PAD] * left + p + c + [PAD] * right)
        mask.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
    return torch.tensor(ids), torch.tensor(mask), [p for p, _ in rows], width_c


@pytest.mark.parametrize("preamble", [None, [100 + i for i in range(15)]])
def test_shared_prompts_give_the_whole_rows_logits_and_gradients(
    preamble: list[int] | None,
) -> None:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(
        build_demo_model(TEST_HOME / "models" / "demo"), dtype=torch.float32
    )
    model = get_peft_model(
        base,
        LoraConfig(
            r=8, lora_alpha=16, target_modules=LORA_TARGETS["qwen2"], init_lora_weights=False
        ),
    )
    ids, mask, prompts, width_c = batch(preamble)
    plan = Plan.of(prompts, width_c)
    assert plan is not None and len(plan.rests) == 3
    assert len(plan.prefix) == (0 if preamble is None else len(preamble))
    assert plan.shared_tokens < ids.numel()  # what is shared saves tokens: the passes run
    completion_mask = mask[:, -width_c:].float()
    results = []
    for share in (False, True):
        model.zero_grad()
        logits = completion_logits(model, ids, mask, prompts, width_c, share=share)
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, -width_c:, None])[..., 0]
        (logp * completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), logp.detach(), grads))
    (whole_logits, whole_logp, whole_grads), (shared_logits, shared_logp, shared_grads) = results
    assert whole_logits.shape == shared_logits.shape == (6, width_c, base.config.vocab_size)
    real = completion_mask.bool()
    torch.testing.assert_close(shared_logp[real], whole_logp[real], rtol=0, atol=1e-4)
    torch.testing.assert_close(shared_logits[real], whole_logits[real], rtol=0, atol=1e-4)
    assert whole_grads.keys() == shared_grads.keys() and len(whole_grads) > 0
    for name, grad in whole_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)


def test_without_sharing_it_is_one_plain_forward() -> None:
    model = AutoModelForCausalLM.from_pretrained(
        build_demo_model(TEST_HOME / "models" / "demo"), dtype=torch.float32
    )
    ids, mask, prompts, width_c = batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, logits_to_keep=width_c + 1).logits
        got = completion_logits(model, ids, mask, prompts, width_c, share=False)
    torch.testing.assert_close(got, expected[:, :-1])


def test_one_prompt_for_every_row_keeps_its_last_token_for_the_answer() -> None:
    plan = Plan.of([[1, 2, 3, 4]] * 3, 2)
    assert plan is not None and plan.prefix == [1, 2, 3] and plan.rests == [[4]]
    assert plan.group == [0, 0, 0]
    assert Plan.of([[1, 2, 3]], 2) is None  # one row: nothing to share
