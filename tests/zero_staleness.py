"""The zero-staleness identity, checked the same way by every e2e test that makes it: a trainer's
claimed transitions, all served by the version its engine holds, batched as its step would batch
them, and each completion token scored by its engine (the log-probability the step would start
from) beside the one vLLM recorded. At zero staleness the two must agree (docs/off_policy.md).
tests/e2e/test_e2e_sampling.py makes it for every sampling setting on the tiny model,
tests/e2e/test_e2e_real_model.py on SmolLM2.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.data.batch import Batch, build_batch, staleness_in
from trainer.data.store import Claimed
from trainer.loop import Trainer


def fresh_batch(trainer: Trainer, claimed: list[Claimed], version: int) -> Batch:
    """`claimed` (every one served by `version`, the engine's) batched as a step would."""
    assert {c.policy_version for c in claimed} == {version}, "not all served by the engine's"
    return build_batch(
        claimed,
        trainer.settings,
        staleness=staleness_in([version], version),
        baseline=None,
        limits=trainer.engine.limits,
        sampling_defaults={},
    )


def scored(trainer: Trainer, samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the learner's log-probability of each completion token, vLLM's recorded one, the mask of
    the completion tokens), per sample, as the engine's GRPO step computes them."""
    rows = [vars(s) | {"prompt": ""} for s in samples]
    out = trainer.engine.trainer._generate_and_score_completions(rows)
    return (
        out["old_per_token_logps"],
        out["sampling_per_token_logps"],
        out["completion_mask"].bool(),
    )
