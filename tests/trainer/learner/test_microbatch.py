"""A step backpropagated in pieces (micro_batch_tokens) is the same step as the whole batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from demo.tiny_model import build_demo_model
from tests.conftest import TEST_HOME
from tests.trainer.learner.test_engine import behaviour_logprobs
from trainer.config import TrainerSettings
from trainer.data.sampling import Sampling
from trainer.learner.engine import Engine, Sample, StepStats
from trainer.learner.microbatch import lengths, pieces, share
from trainer.learner.sft import Demo, SftStats

PROMPTS = [
    [1, 30, 31, 32],
    [1, 40, 41],
    [1, 50, 51, 52, 53, 54, 55],
    [1, 60],
    [1, 70, 71],
    [1],
    [1, 80],
]
COMPLETIONS = [
    [100, 101, 102],
    [110, 111],
    [120, 121, 122, 123, 124],
    [130, 2],
    [140],
    [150, 151],
    [160, 161, 162, 163],
]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25]


def settings_for(tmp: Path, **overrides: Any) -> TrainerSettings:
    return TrainerSettings(
        model=build_demo_model(TEST_HOME / "models" / "demo"),
        vllm=["http://127.0.0.1:9"],
        adapters_dir=tmp / "adapters",
        home=tmp,
        learning_rate=5e-3,
        **overrides,
    )


def samples(engine: Engine, *, stale: bool = False) -> list[Sample]:
    out = []
    for i, (p, c, a) in enumerate(zip(PROMPTS, COMPLETIONS, ADVANTAGES, strict=True)):
        logprobs = behaviour_logprobs(engine, p, c)
        if stale and i % 2:  # a behaviour policy that differs: weights and rejection differ by row
            logprobs = [lp - 0.3 * (j + 1) for j, lp in enumerate(logprobs)]
        sampling = Sampling(temperature=0.7, top_k=50) if i == 2 else Sampling()
        out.append(Sample(p, c, logprobs, a, a, sampling, staleness=i % 2))
    return out


def demonstrations() -> list[Demo]:
    """The test batch's prompts and completions, as demonstrations."""
    return [Demo(p, c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]


def gradient_of_one_sft_step(engine: Engine, demos: list[Demo]) -> tuple[dict[str, Any], SftStats]:
    """The adapter's gradient as the supervised optimizer steps with it."""
    seen: dict[str, Any] = {}

    def capture(*_: Any) -> None:
        for name, p in engine.model.named_parameters():
            if p.grad is not None:
                seen[name] = p.grad.detach().clone()

    engine.sft_optimizer.register_step_pre_hook(capture)
    return seen, engine.sft_step(demos)


def gradient_of_one_step(engine: Engine, batch: list[Sample]) -> tuple[dict[str, Any], StepStats]:
    """The adapter's gradient as the optimizer steps with it."""
    seen: dict[str, Any] = {}

    def capture(*_: Any) -> None:
        for name, p in engine.model.named_parameters():
            if p.grad is not None:
                seen[name] = p.grad.detach().clone()

    engine.trainer.optimizer.register_step_pre_hook(capture)
    return seen, engine.step(batch)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_pieces_give_the_whole_batchs_gradient(loss_type: str, tmp_path: Path) -> None:
    whole = Engine(settings_for(tmp_path / "a", loss_type=loss_type))
    cut = Engine(settings_for(tmp_path / "b", loss_type=loss_type, micro_batch_tokens=12))
    batch = samples(whole, stale=True)
    prepared = cut.trainer.prepare([vars(s) | {"prompt": ""} for s in batch])
    assert len(pieces(prepared, 12)) >= 3  # the budget really cut the batch
    g_whole, whole_stats = gradient_of_one_step(whole, batch)
    g_cut, cut_stats = gradient_of_one_step(cut, batch)
    assert g_whole.keys() == g_cut.keys() and g_whole
    largest = max(float(g.abs().max()) for g in g_whole.values())
    assert largest > 0
    worst = max(float((g_whole[n] - g_cut[n]).abs().max()) for n in g_whole)
    assert worst <= 1e-5 * largest, (worst, largest)
    assert cut_stats.loss == pytest.approx(whole_stats.loss, rel=1e-5, abs=1e-7)


def test_without_the_share_the_pieces_would_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row-mean losses need the share: with it forced to 1, grpo's gradient is not the
    whole batch's (so the test above can fail)."""
    whole = Engine(settings_for(tmp_path / "a", loss_type="grpo"))
    cut = Engine(settings_for(tmp_path / "b", loss_type="grpo", micro_batch_tokens=12))
    batch = samples(whole, stale=True)
    g_whole, _ = gradient_of_one_step(whole, batch)
    monkeypatch.setattr("trainer.learner.engine.share", lambda *_: 1.0)
    g_cut, _ = gradient_of_one_step(cut, batch)
    largest = max(float(g.abs().max()) for g in g_whole.values())
    worst = max(float((g_whole[n] - g_cut[n]).abs().max()) for n in g_whole)
    assert worst > 1e-3 * largest


def padded_batch() -> dict[str, Any]:
    """TRL's layout: prompts left-padded, completions right-padded (a hole where a tool's
    tokens are masked is still inside the completion)."""
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    return {
        "prompt_ids": torch.arange(12).view(4, 3) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.arange(16).view(4, 4) * completion_mask,
        "completion_mask": completion_mask,
        "tool_mask": torch.ones(4, 4, dtype=torch.long),
        "advantages": torch.tensor([1.0, 2.0, 3.0, 4.0]),
        "row": torch.arange(4),
        "num_items_in_batch": torch.tensor(9),  # completion tokens kept
        "rows_in_batch": torch.tensor(4),
    }


def test_pieces_hold_every_row_once_trimmed_to_their_own_lengths() -> None:
    batch = padded_batch()
    parts = pieces(batch, budget=10)
    rows = sorted(r for part in parts for r in part["row"].tolist())
    assert rows == [0, 1, 2, 3]
    for part in parts:
        assert part["num_items_in_batch"] is batch["num_items_in_batch"]
        for i, r in enumerate(part["row"].tolist()):
            p = part["prompt_mask"].size(1)
            c = part["completion_mask"].size(1)
            assert len(part["row"]) * (p + c) <= 10 or len(part["row"]) == 1
            # nothing unmasked was cut off
            assert part["prompt_mask"][i].sum() == batch["prompt_mask"][r].sum()
            assert part["completion_mask"][i].sum() == batch["completion_mask"][r].sum()
            assert torch.equal(part["prompt_ids"][i], batch["prompt_ids"][r, 3 - p :])
            assert torch.equal(part["completion_ids"][i], batch["completion_ids"][r, :c])
    assert pieces(batch, budget=0) == [batch]
    assert len(pieces(batch, budget=1)) == 4  # a row longer than the budget is a piece alone


def test_ranks_cut_their_pieces_alike_each_within_the_budget() -> None:
    """TRL gathers per-row metrics in every loss pass: each rank's pieces must match in number
    and rows, though each rank's rows have their own lengths."""
    long, short = padded_batch(), padded_batch()
    short["prompt_mask"] = torch.tensor([[0, 0, 1]] * 4)
    short["completion_mask"] = torch.tensor([[1, 0, 0, 0]] * 4)
    alone = [[len(p["row"]) for p in pieces(b, 10)] for b in (long, short)]
    assert alone == [[1, 2, 1], [4]]  # left to themselves they would differ
    ranks = [lengths(long), lengths(short)]
    cut = [pieces(b, 10, ranks) for b in (long, short)]
    assert [len(p["row"]) for p in cut[0]] == [len(p["row"]) for p in cut[1]] == [1, 2, 1]
    for parts in cut:
        assert sorted(r for p in parts for r in p["row"].tolist()) == [0, 1, 2, 3]
        for p in parts:
            size = len(p["row"]) * (p["prompt_mask"].size(1) + p["completion_mask"].size(1))
            assert size <= 10 or len(p["row"]) == 1
    with pytest.raises(ValueError, match="as many rows"):
        pieces(long, 10, [lengths(long), lengths(long)[:3]])


def test_shares_add_up_to_one_whole_batch() -> None:
    batch = padded_batch()
    parts = pieces(batch, budget=10)
    for loss_type in ["grpo", "dr_grpo", "bnpo"]:
        assert sum(share(loss_type, p, batch) for p in parts) == pytest.approx(1.0)
    assert all(share("dapo", p, batch) == 1.0 for p in parts)
    with pytest.raises(ValueError, match="loss_type"):
        share("made_up", parts[0], batch)


def test_a_batch_key_of_unknown_shape_is_refused_not_sliced_wrong() -> None:
    batch = padded_batch() | {"something_new": torch.zeros(4, 4)}
    with pytest.raises(ValueError, match="something_new"):
        pieces(batch, budget=10)
