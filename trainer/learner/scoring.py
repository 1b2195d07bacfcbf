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


def completion_logprobs(
    model: Any,
    rows: Sequence[Completion],
    *,
    pad_id: int,
    device: torch.device,
    share: bool,
    rows_per_pass: int = 8,
) -> list[float]:
    """Each row's completion log-probability (summed over its tokens) under `model`."""
    out: list[float] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(rows), rows_per_pass):
                out += _pass(model, rows[start : start + rows_per_pass], pad_id, device, share)
    finally:
        model.train(was_training)
    return out


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
