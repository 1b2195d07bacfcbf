"""Supervised steps on demonstrations: imitate the answer a prompt should get (TRL's SFT loss on
the completion tokens only), on the lineage's own adapter, published and hot-swapped like a GRPO
step. How they interleave with GRPO steps is the `demonstrations` setting (trainer/loop.py).

A demonstration copied from a recorded call is its token ids as vLLM sampled them. A posted one
(chat messages, tools, an assistant answer) is rendered with the model's own chat template as
vLLM renders a chat call: the prompt with the generation prompt, tokenised without special tokens
added; the answer is what the template adds for the assistant turn, up to and including the
first token that ends a generation (the tokenizer's and generation config's end-of-sequence
tokens), so the model learns to stop where it would be stopped.

The loss is the mean negative log-likelihood of the completion tokens (every token of the batch
weighs the same, as TRL's SFTTrainer with `completion_only_loss`), backpropagated in pieces of at
most `micro_batch_tokens` padded tokens that add up to the whole batch's gradient. The optimizer
is an AdamW of its own (`sft_learning_rate`): GRPO's moments never see supervised gradients, which
are far larger and would shrink its steps for thousands of steps after a warm start.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.data.batch import ModelLimits
from trainer.data.demonstrations import ClaimedDemonstration
from trainer.learner import microbatch
from trainer.learner.shared_prompts import completion_logits, padded


@dataclass(frozen=True)
class Demo:
    """One demonstration as the learner sees it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    ballast: bool = False  # evens out ranks' shards (trainer/distributed.shard); nothing learned


@dataclass(frozen=True)
class SftStats:
    loss: float  # mean negative log-likelihood per completion token, before the step
    tokens: int  # completion tokens learned from
    seconds: float


@dataclass
class Rendered:
    demos: dict[str, Demo]  # demonstration id -> its tokens
    skipped: dict[str, str]  # demonstration id -> why it cannot be trained


def stop_ids(tokenizer: Any, model_dir: Path) -> set[int]:
    """The tokens that end a generation: the tokenizer's end of sequence and the generation
    config's (vLLM stops on both)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = model_dir / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    return ids


def render(
    claimed: list[ClaimedDemonstration], tokenizer: Any, stops: set[int], limits: ModelLimits
) -> Rendered:
    out = Rendered({}, {})
    for c in claimed:
        try:
            prompt, completion = _tokens(c, tokenizer, stops)
        except Exception:  # a template that cannot render what was posted (its own words: log)
            out.skipped[c.id] = "template_error"
            continue
        ids = (*prompt, *completion)
        if not prompt or not completion:
            out.skipped[c.id] = "empty_answer"
        elif min(ids) < 0 or max(ids) >= limits.vocab_size:
            out.skipped[c.id] = "token_out_of_vocab"
        elif len(ids) > limits.max_length:
            out.skipped[c.id] = "too_long"
        else:
            out.demos[c.id] = Demo(prompt, completion)
    return out


def _tokens(
    c: ClaimedDemonstration, tokenizer: Any, stops: set[int]
) -> tuple[list[int], list[int]]:
    if c.prompt_token_ids is not None and c.completion_token_ids is not None:
        return c.prompt_token_ids, c.completion_token_ids
    assert c.messages is not None and c.completion is not None
    template: Callable[..., str] = tokenizer.apply_chat_template
    prompt = template(c.messages, tools=c.tools, add_generation_prompt=True, tokenize=False)
    whole = template([*c.messages, c.completion], tools=c.tools, tokenize=False)
    if not whole.startswith(prompt):
        raise ValueError("the chat template renders the prompt differently with its answer")
    answer = tokenizer(whole[len(prompt) :], add_special_tokens=False)["input_ids"]
    end = next((i for i, t in enumerate(answer) if t in stops), None)
    completion = answer[: end + 1] if end is not None else answer
    return tokenizer(prompt, add_special_tokens=False)["input_ids"], completion


def backward(
    model: Any,
    demos: list[Demo],
    *,
    budget: int,
    pad_id: int,
    device: torch.device,
    total: float,
    share: bool = False,
    ranks: Sequence[list[tuple[int, int]]] = (),
) -> float:
    """Backpropagate the batch's completion NLL (summed, divided by `total`, the completion
    tokens of the whole step over every rank) in pieces of at most `budget` padded tokens
    (0: one piece); `share`: what their prompts share forwarded once
    (trainer/learner/shared_prompts.py: a system prompt, a task's preamble); `ranks`: every
    rank's `lengths`, to cut alike.
    Returns this batch's part of the loss."""
    loss = 0.0
    for piece in _pieces(demos, budget, ranks):
        ids, attention, targets, mask = _padded(piece, pad_id, device)
        logits = completion_logits(
            model, ids, attention, [d.prompt_ids for d in piece], targets.size(1), share=share
        ).float()  # the logits before each completion token
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
        ).view_as(targets)
        part = (nll * mask).sum() / total
        part.backward()  # type: ignore[no-untyped-call]
        loss += float(part.item())
    return loss


def completion_tokens(demos: list[Demo]) -> int:
    return sum(len(d.completion_ids) for d in demos if not d.ballast)


def lengths(demos: list[Demo]) -> list[tuple[int, int]]:
    """Each row's prompt and completion length, longest rows first (the order pieces take)."""
    return [(len(d.prompt_ids), len(d.completion_ids)) for d in _longest_first(demos)]


def _longest_first(demos: list[Demo]) -> list[Demo]:
    return sorted(demos, key=lambda d: -(len(d.prompt_ids) + len(d.completion_ids)))


def _pieces(
    demos: list[Demo], budget: int, ranks: Sequence[list[tuple[int, int]]] = ()
) -> list[list[Demo]]:
    """Consecutive rows (longest first) whose padded size stays within `budget` tokens; with
    `ranks` (every rank's `lengths`, as many rows each) cut at the same row counts on every rank,
    within the budget everywhere: under FSDP2 each forward pass is a collective."""
    rows = _longest_first(demos)
    if budget <= 0:
        return [rows]
    return [rows[s] for s in microbatch.cuts(list(ranks) or [lengths(demos)], budget)]


def _padded(
    demos: list[Demo], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded, completions right-padded (as a GRPO batch): ids, attention mask,
    the completion tokens and the mask of those learned from."""
    ids, attention = padded(
        [d.prompt_ids for d in demos], [d.completion_ids for d in demos], pad_id, device
    )
    width_c = max(len(d.completion_ids) for d in demos)
    targets, mask = [], []
    for d in demos:
        right = width_c - len(d.completion_ids)
        targets.append(d.completion_ids + [pad_id] * right)
        learn = 0 if d.ballast else 1
        mask.append([learn] * len(d.completion_ids) + [0] * right)
    return (
        ids,
        attention,
        torch.tensor(targets, dtype=torch.long, device=device),
        torch.tensor(mask, dtype=torch.float32, device=device),
    )
