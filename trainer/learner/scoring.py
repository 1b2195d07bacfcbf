"""Log-probabilities of recorded completions under the weights the model has now, without
gradients: what off-policy evaluation (trainer/ope.py) weighs a candidate's calls with.

The rows are laid out as a training step lays them out (left-padded prompts, right-padded
completions, trainer/learner/shared_prompts.py), and each token's log-probability is taken
under its call's own sampling distribution (trainer/learner/logprobs.py), so at the weights that
served a call the sum equals the recorded behaviour log-probabilities' to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trainer.data.sampling import Sampling
from trainer.learner.logprobs import processed_logprobs
from trainer.learner.microbatch import cuts
from trainer.learner.shared_prompts import completion_logits, padded


@dataclass(frozen=True)
class Completion:
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    sampling: Sampling


class Scorer(Protocol):
    """What scores completions under some weights: an engine, an engine at a snapshot's weights
    (`AtWeights`), or rank 0 dealing the rows out to every rank (trainer/learner/ranks.py)."""

    def score(self, rows: Sequence[Completion]) -> list[float]: ...


# A pass's padded tokens (rows x longest prompt+completion) where `micro_batch_tokens` sets none:
# its logits are at most this many tokens over the vocabulary, what 8 rows of 512 tokens made.
PASS_TOKENS = 4096
MIN_ROWS = 8  # never fewer rows a pass than before there was a budget, unless one is set


def completion_logprobs(
    model: Any,
    rows: Sequence[Completion],
    *,
    pad_id: int,
    device: torch.device,
    share: bool,
    pass_tokens: int = 0,
) -> list[float]:
    """Each row's completion log-probability (summed over its tokens) under `model`, in passes
    of rows of about one length (identical prompts together, for `share`), each at most
    `pass_tokens` padded tokens (0: PASS_TOKENS, and at least MIN_ROWS rows): short calls go
    many to a pass, which is most of what scoring a window of them costs."""
    order = sorted(range(len(rows)), key=lambda i: _length(rows[i]), reverse=True)
    out = [0.0] * len(rows)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for piece in _pieces(order, rows, pass_tokens):
                for i, value in zip(
                    piece,
                    _pass(model, [rows[i] for i in piece], pad_id, device, share),
                    strict=True,
                ):
                    out[i] = value
    finally:
        model.train(was_training)
    return out


def _length(row: Completion) -> tuple[int, int, tuple[int, ...]]:
    return len(row.prompt_ids) + len(row.completion_ids), len(row.prompt_ids), tuple(row.prompt_ids)


def _pieces(order: list[int], rows: Sequence[Completion], budget: int) -> list[list[int]]:
    """`order` cut as a training step's batch is (trainer/learner/microbatch.py `cuts`):
    consecutive rows while a pass's padded tokens stay within the budget. 0: PASS_TOKENS, or
    what MIN_ROWS of the longest prompt and completion take, if more."""
    if not order:
        return []
    lengths = [(len(rows[i].prompt_ids), len(rows[i].completion_ids)) for i in order]
    if budget <= 0:
        longest = max(p for p, _ in lengths) + max(c for _, c in lengths)
        budget = max(PASS_TOKENS, MIN_ROWS * longest)
    return [order[s] for s in cuts([lengths], budget)]


def _pass(
    model: Any, rows: Sequence[Completion], pad_id: int, device: torch.device, share: bool
) -> list[float]:
    prompts = [list(r.prompt_ids) for r in rows]
    ids_BT, mask_BT = padded(prompts, [r.completion_ids for r in rows], pad_id, device)
    C = max(len(r.completion_ids) for r in rows)
    logits = completion_logits(model, ids_BT, mask_BT, prompts, C, share=share)
    logps, _ = processed_logprobs(
        logits.float(), ids_BT[:, -C:], mask_BT[:, -C:], prompts, [r.sampling for r in rows]
    )
    sums: list[float] = (logps * mask_BT[:, -C:]).sum(dim=1).tolist()
    return sums
