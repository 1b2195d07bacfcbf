"""The promotion gate (FLYWHEEL_GATE): a new version's fate decided before any user sees it,
from its off-policy estimate (`ope`, trainer/candidate.py; before vLLM ever loads it), its eval
sets (`evals`, trainer/evals.py), or both (`combine`: each must pass).

The estimate (`decide`):

    fail          it moved away from everything logged (its mean weight under
                  `gate_min_weight`, or too few effective episodes in a window where the
                  current version has enough), or
                  it is estimated worse than the current version beyond `gate_margin` (the
                  difference's interval wholly below -margin): recorded, retired, never served;
                  training goes on from the current version
    pass          not worse by more than the margin (the interval wholly above -margin)
    inconclusive  too few logged (or effective) episodes yet, or an interval across -margin: the
                  fallback
                  (`gate_fallback`): publish as without a gate, open a canary, or reject

The eval sets (`from_evals`): fail when the version scores under the current version's by more
than `gate_eval_margin` on any set; pass otherwise; inconclusive when the lineage has none.

Both (`combine`, FLYWHEEL_GATE_EVALS=always): each must pass. Or the estimate first
(`settle`, FLYWHEEL_GATE_EVALS=undecided): its pass or fail stands, and only where it cannot
decide are the eval sets asked, and they decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.candidate import Evaluated
from trainer.evals import Compared

Outcome = Literal["pass", "fail", "inconclusive"]


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str


def decide(
    judged: Evaluated | None, *, margin: float, min_weight: float, min_ess: float
) -> Verdict:
    c = judged.comparison if judged is not None else None
    if judged is None or c is None or judged.episodes < min_ess:
        n = judged.episodes if judged is not None else 0
        return Verdict(
            "inconclusive",
            f"{n} logged episode(s) to estimate on, under the {min_ess:g} needed",
        )
    cand = c.candidate
    if cand.mean_weight < min_weight:
        return Verdict(
            "fail",
            f"it gives the logged answers {cand.mean_weight:.2g} of the probability the "
            f"behaviour did, under {min_weight:g}: it says what was never logged",
        )
    if c.current.refused is not None:  # the window is too thin for any version yet
        return Verdict(
            "inconclusive",
            f"too few effective episodes even for the current version: {c.current.refused}",
        )
    if cand.refused is not None or c.difference.value is None:
        return Verdict("fail", f"too far from the logged traffic: {cand.refused}")
    d = c.difference
    assert d.low is not None and d.high is not None and cand.value is not None
    said = (
        f"estimated {cand.value:.3f} against the current version's {c.current.value:.3f}, "
        f"difference {d.value:+.3f} [{d.low:+.3f}, {d.high:+.3f}] on {judged.episodes} episodes"
    )
    if d.high < -margin:
        return Verdict("fail", f"{said}: worse by more than the margin {margin:g}")
    if d.low > -margin:
        return Verdict("pass", f"{said}: not worse by the margin {margin:g}")
    return Verdict("inconclusive", f"{said}: the interval spans -{margin:g}")


def from_evals(compared: list[Compared], *, margin: float) -> Verdict:
    if not compared:
        return Verdict("inconclusive", "the lineage has no eval sets (flywheel eval add)")
    # Scores are counts over a set's items: 49/50 against 50/50 is a loss of exactly 0.02,
    # which must not fail a margin of 0.02 for a rounding error (the benchmark's v26 did).
    worse = [c for c in compared if c.difference < -margin - 1e-9]
    said = "; ".join(
        f"eval {c.name} {c.candidate.score:.3f} against v{c.current_version}'s "
        f"{c.current.score:.3f}"
        for c in (worse or compared)
    )
    if worse:
        return Verdict("fail", f"{said}: worse by more than the margin {margin:g}")
    return Verdict("pass", f"{said}: not worse by the margin {margin:g}")


def combine(verdicts: list[Verdict]) -> Verdict:
    """Each must pass: any fail fails (its reasons), else any inconclusive is inconclusive."""
    outcomes: tuple[Outcome, ...] = ("fail", "inconclusive")
    for outcome in outcomes:
        said = [v.reason for v in verdicts if v.outcome == outcome]
        if said:
            return Verdict(outcome, " | ".join(said))
    return Verdict("pass", " | ".join(v.reason for v in verdicts))


def settle(estimated: Verdict, on_evals: Verdict) -> Verdict:
    """The estimate decides; where it cannot, the eval sets do (inconclusive again without any)."""
    if estimated.outcome != "inconclusive":
        return estimated
    return Verdict(on_evals.outcome, f"{estimated.reason} | {on_evals.reason}")
