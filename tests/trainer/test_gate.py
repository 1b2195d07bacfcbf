"""The promotion gate's decision (trainer/gate.py) on estimates of each kind; what the trainer
does with each verdict is in tests/trainer/test_trainer_loop.py."""

from __future__ import annotations

from trainer.candidate import Evaluated
from trainer.evals import Compared, Score
from trainer.gate import Verdict, combine, decide, from_evals, settle
from trainer.ope import Comparison, Estimate

SETTINGS = {"margin": 0.05, "min_weight": 0.1, "min_ess": 30.0}


def judged(
    difference: tuple[float, float, float] | None,
    *,
    episodes: int = 200,
    mean_weight: float = 0.95,
    refused: str | None = None,
    current_refused: str | None = None,
) -> Evaluated:
    if refused is not None or difference is None:
        cand = Estimate(None, None, None, 5.0, episodes, refused, mean_weight)
        diff = Estimate(None, None, None, 5.0, episodes, refused)
    else:
        value, low, high = difference
        cand = Estimate(0.5 + value, 0.4, 0.6, 150.0, episodes, mean_weight=mean_weight)
        diff = Estimate(value, low, high, 150.0, episodes)
    current = Estimate(0.5, 0.45, 0.55, 200.0, episodes)
    if current_refused is not None:
        current = Estimate(None, None, None, 29.0, episodes, current_refused)
    return Evaluated(Comparison(cand, current, diff, 0.5), episodes=episodes, calls=episodes)


def test_not_worse_by_the_margin_passes() -> None:
    v = decide(judged((0.02, -0.01, 0.05)), **SETTINGS)
    assert v.outcome == "pass" and "not worse by the margin 0.05" in v.reason


def test_clearly_worse_fails() -> None:
    v = decide(judged((-0.2, -0.3, -0.1)), **SETTINGS)
    assert v.outcome == "fail" and "worse by more than the margin" in v.reason


def test_an_interval_across_the_margin_is_inconclusive() -> None:
    v = decide(judged((-0.03, -0.12, 0.06)), **SETTINGS)
    assert v.outcome == "inconclusive" and "spans -0.05" in v.reason


def test_too_few_logged_episodes_is_inconclusive_not_a_failure() -> None:
    assert decide(judged((0.0, -0.1, 0.1), episodes=12), **SETTINGS).outcome == "inconclusive"
    assert decide(None, **SETTINGS).outcome == "inconclusive"
    assert decide(Evaluated(None), **SETTINGS).outcome == "inconclusive"


def test_a_window_too_thin_for_the_current_version_too_is_inconclusive_not_a_failure() -> None:
    # Measured: 31 episodes, both versions' effective sample sizes 29.1 under the 30 needed.
    thin = "not enough overlap: the effective sample size of 31 episodes is 29.1"
    v = decide(judged(None, episodes=31, refused=thin, current_refused=thin), **SETTINGS)
    assert v.outcome == "inconclusive" and "even for the current version" in v.reason


def test_a_version_that_moved_away_from_everything_logged_fails() -> None:
    # What a corrupted adapter looks like: self-normalised, its estimate may look fine.
    v = decide(judged((0.1, 0.05, 0.15), mean_weight=0.001), **SETTINGS)
    assert v.outcome == "fail" and "never logged" in v.reason
    v = decide(judged(None, refused="not enough overlap: ..."), **SETTINGS)
    assert v.outcome == "fail" and "too far from the logged traffic" in v.reason


def eval_set(candidate: int, current: int, items: int = 50) -> Compared:
    """Scores as the trainer computes them: a mean of 0/1 items."""
    return Compared(
        "sums",
        "d",
        Score(sum([1.0] * candidate + [0.0] * (items - candidate)) / items, items, 0, 1.0),
        Score(sum([1.0] * current + [0.0] * (items - current)) / items, items, 0, 0.0),
        1,
    )


def test_the_eval_sets_fail_a_version_worse_by_more_than_the_margin_only() -> None:
    # The benchmark's v26: 49 of 50 against 50 of 50 is a loss of exactly the margin 0.02.
    assert from_evals([eval_set(49, 50)], margin=0.02).outcome == "pass"
    worse = from_evals([eval_set(49, 50), eval_set(48, 50)], margin=0.02)
    assert worse.outcome == "fail" and "0.960 against v1's 1.000" in worse.reason
    assert from_evals([], margin=0.02).outcome == "inconclusive"


def test_an_eval_sets_stats_read_back_as_the_same_comparison() -> None:
    compared = eval_set(47, 49)
    again = Compared.from_stats("sums", compared.stats())
    assert again.stats() == compared.stats() and again.difference == compared.difference


def test_each_witness_must_pass() -> None:
    ok, unsure, bad = Verdict("pass", "a"), Verdict("inconclusive", "b"), Verdict("fail", "c")
    assert combine([ok, ok]).outcome == "pass"
    assert combine([ok, unsure]) == Verdict("inconclusive", "b")
    assert combine([unsure, bad, ok]) == Verdict("fail", "c")


def test_the_estimate_settles_what_it_can_and_the_eval_sets_the_rest() -> None:
    """FLYWHEEL_GATE_EVALS=undecided: the estimate's pass or fail stands whatever the eval sets
    would say; an estimate that cannot decide leaves the decision to them."""
    ok, unsure, bad = Verdict("pass", "a"), Verdict("inconclusive", "b"), Verdict("fail", "c")
    assert settle(ok, bad) == ok and settle(bad, ok) == bad
    assert settle(unsure, ok) == Verdict("pass", "b | a")
    assert settle(unsure, bad) == Verdict("fail", "b | c")
    none = from_evals([], margin=0.02)  # the lineage has no eval sets: still undecided
    assert settle(unsure, none).outcome == "inconclusive"
