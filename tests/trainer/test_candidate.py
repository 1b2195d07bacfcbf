"""How a candidate's logged window becomes weights (trainer/candidate.py): which calls are
weighed, what leaves an episode out, and the ratios put where their calls are. The scorer is a
stand-in that returns chosen log-probabilities; the real one is checked against vLLM's recorded
log-probabilities in tests/e2e/test_e2e_sampling.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from trainer.candidate import Evaluated, evaluate
from trainer.config import TrainerSettings
from trainer.data.batch import ModelLimits
from trainer.data.logged import LoggedCall
from trainer.learner.scoring import Completion

LIMITS = ModelLimits(vocab_size=100, max_length=64)
FIXED = {"sampling_defaults": {}, "limits": LIMITS}


def call(episode: str, *, ours: bool = True, final: float = 1.0, **kw: object) -> LoggedCall:
    fields: dict[str, object] = {
        "episode_id": episode,
        "task_id": "t",
        "final_reward": final,
        "ours": ours,
        "policy_version": 3,
        "step_reward": 0.0,
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [4, 5],
        "logprobs": [-1.0, -1.0],
        "params": {"temperature": 1.0},
        "made_tool_call": False,
        "route": "chat",
    }
    return LoggedCall(**(fields | kw))  # type: ignore[arg-type]


class Scorer:
    """The candidate's log-probability of each completion: `by_token[first completion id]`."""

    def __init__(self, by_token: dict[int, float]) -> None:
        self.by_token = by_token
        self.seen: list[Completion] = []

    def score(self, rows: list[Completion]) -> list[float]:
        self.seen += rows
        return [self.by_token[r.completion_ids[0]] for r in rows]


def settings(tmp_path: Path) -> TrainerSettings:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return TrainerSettings(
        model=tmp_path,
        vllm=["http://x"],
        adapters_dir=tmp_path,
        ope="log",
        # the hand-computed values below; DR's own are tests/trainer/test_ope.py's
        ope_method="wis",
        ope_min_ess=1,
        ope_resamples=20,
    )


def test_only_the_lineages_calls_are_weighed_and_unweighable_episodes_are_left_out(
    tmp_path: Path,
) -> None:
    calls = [
        call("good", completion_token_ids=[7, 5], final=1.0),  # the candidate likes it: e^1
        call("good", ours=False, step_reward=0.5),  # another model's call: weight 1
        call("bad", completion_token_ids=[8, 5], final=0.0),  # the candidate dislikes it: e^-1
        call("greedy", params={"temperature": 0}),
        call("greedy", completion_token_ids=[7, 5]),
        call("unlogged", logprobs=None),
        call("long", prompt_token_ids=list(range(63))),
    ]
    scorer = Scorer({7: -1.0, 8: -3.0})  # recorded: -2.0 for each
    judged = evaluate(
        scorer,
        Scorer({}),
        calls,
        settings(tmp_path),
        current_version=3,
        **FIXED,  # type: ignore[arg-type]
    )
    assert judged.episodes == 2 and judged.calls == 2
    assert [r.completion_ids[0] for r in scorer.seen] == [7, 8]
    assert dict(judged.left_out) == {"greedy": 1, "missing_logprobs": 1, "too_long": 1}
    c = judged.comparison
    assert c is not None and c.logged == pytest.approx((1.5 + 0.0) / 2)
    # Self-normalised: (e * 1.5 + e^-1 * 0) / (e + e^-1).
    expected = math.e * 1.5 / (math.e + 1 / math.e)
    assert c.candidate.value == pytest.approx(expected)
    assert c.current.value == pytest.approx(c.logged)
    assert "ope: candidate" in judged.line() and judged.stats()["left_out"]["greedy"] == 1
    # What the version's stats keep reads back as the same judgement (a report's re-judging).
    again = Evaluated.from_stats(judged.stats())
    assert again.stats() == judged.stats() and again.line() == judged.line()


def test_nothing_to_estimate_on_says_why(tmp_path: Path) -> None:
    nothing = Scorer({})
    unlogged = [call("e", logprobs=None)]
    judged = evaluate(nothing, nothing, unlogged, settings(tmp_path), current_version=3, **FIXED)  # type: ignore[arg-type]
    assert judged.comparison is None and "1 missing_logprobs" in judged.line()
    judged = evaluate(nothing, nothing, [], settings(tmp_path), current_version=3, **FIXED)  # type: ignore[arg-type]
    assert "no logged episode" in judged.line()


def test_calls_another_version_served_are_scored_under_the_current_versions_weights_too(
    tmp_path: Path,
) -> None:
    calls = [
        call("own", completion_token_ids=[7, 5]),  # served by v3, the current one: ratio 1
        call("held", completion_token_ids=[8, 5], policy_version=1, final=0.0),  # by v1
    ]
    new, now = Scorer({7: -1.0, 8: -1.0}), Scorer({8: -3.0})
    judged = evaluate(new, now, calls, settings(tmp_path), current_version=3, **FIXED)  # type: ignore[arg-type]
    assert [r.completion_ids[0] for r in now.seen] == [8] and judged.rescored == 1
    c = judged.comparison
    assert c is not None
    # The current version: own 1, held e^(-3 - -2) = e^-1; the candidate: e^1 for both.
    assert c.current.value == pytest.approx(1.0 / (1 + 1 / math.e))
    assert c.candidate.value == pytest.approx(0.5)


def test_the_current_versions_scores_from_its_own_estimate_are_not_asked_again(
    tmp_path: Path,
) -> None:
    """What the trainer keeps of a published candidate's estimate (`scores`, by transition id)
    stands in for the current version's forward passes at the next estimate: the same values,
    one pass fewer per call it covers."""
    calls = [
        call("a", completion_token_ids=[7, 5], policy_version=1, id="t1"),
        call("b", completion_token_ids=[8, 5], policy_version=1, final=0.0, id="t2"),
    ]
    first = evaluate(Scorer({7: -1.0, 8: -3.0}), Scorer({7: -2.0, 8: -2.0}), calls,
                     settings(tmp_path), current_version=2, **FIXED)  # type: ignore[arg-type]  # fmt: skip
    assert first.scores == {"t1": -1.0, "t2": -3.0} and first.reused == 0
    # That candidate was published as v3; the next one is compared with it.
    asked = Scorer({7: -1.0, 8: -3.0})  # v3's own weights, were they asked
    fresh = evaluate(Scorer({7: -2.0, 8: -2.0}), asked, calls, settings(tmp_path),
                     current_version=3, **FIXED)  # type: ignore[arg-type]  # fmt: skip
    only_t2 = Scorer({8: -3.0})  # t1 asked of it would raise KeyError
    kept = evaluate(Scorer({7: -2.0, 8: -2.0}), only_t2, calls, settings(tmp_path),
                    current_version=3, known={"t1": -1.0}, **FIXED)  # type: ignore[arg-type]  # fmt: skip
    assert [r.completion_ids[0] for r in only_t2.seen] == [8]
    assert kept.reused == 1 and kept.rescored == 2 and fresh.reused == 0
    assert kept.comparison is not None and fresh.comparison is not None
    assert kept.comparison.current.value == pytest.approx(fresh.comparison.current.value)
    assert kept.stats()["reused"] == 1
