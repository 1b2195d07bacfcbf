"""The batch a step trains on (trainer/data/batch.py): staleness counts the trained lineage's own
versions; a group with no signal is set aside or trained, as FLYWHEEL_FLAT_GROUPS says."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import TrainerSettings
from trainer.data.batch import ModelLimits, build_batch, staleness_in
from trainer.data.store import Claimed


def test_staleness_counts_only_the_lineages_own_publishes() -> None:
    # The writer's versions are 1, 4 and 9: numbers 2, 3 and 5-8 went to other lineages.
    staleness = staleness_in([1, 4, 9], current=9)
    assert staleness(9) == 0
    assert staleness(4) == 1  # one writer version since (not 5 numbers)
    assert staleness(1) == 2
    assert staleness(0) == 3  # sampled from the base model
    # After a rollback to v4, what v9 sampled is not "stale" by a negative amount.
    assert staleness_in([1, 4, 9], current=4)(9) == 0
    assert staleness_in([], current=0)(0) == 0


def claimed(tid: str, task: str, ret: float) -> Claimed:
    return Claimed(
        id=tid,
        episode_id=f"e{tid}",
        task_id=task,
        agent_name="a",
        policy_version=0,
        ret=ret,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        logprobs=[-0.5, -0.5],
        params={"temperature": 1.0},
        made_tool_call=False,
        age_s=1.0,
    )


@pytest.mark.parametrize("flat", ["skip", "train"])
def test_a_group_with_no_signal_is_set_aside_or_trained(tmp_path: Path, flat: str) -> None:
    rows = [claimed("1", "solved", 1.0), claimed("2", "solved", 1.0)]
    rows += [claimed("3", "mixed", 1.0), claimed("4", "mixed", 0.0)]
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    settings = TrainerSettings(
        model=tmp_path, vllm=["http://x"], adapters_dir=tmp_path, flat_groups=flat
    )
    batch = build_batch(
        rows,
        settings,
        staleness=staleness_in([], current=0),
        baseline=None,
        limits=ModelLimits(vocab_size=10, max_length=16),
        sampling_defaults={},
    )
    if flat == "skip":
        assert batch.skipped == {"1": "no_signal", "2": "no_signal"}
        assert sorted(batch.trained) == ["3", "4"]
        assert [s.advantage for s in batch.samples] == pytest.approx([1.0, -1.0], abs=1e-3)
    else:
        assert batch.skipped == {} and sorted(batch.trained) == ["1", "2", "3", "4"]
        assert [s.advantage for s in batch.samples][:2] == [0.0, 0.0]
