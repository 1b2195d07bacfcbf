"""The off-policy correction: importance weights and rejection, from the recorded behaviour
log-probabilities to the learner's (docs/off_policy.md).

Per completion token t of a transition sampled by version N (the behaviour policy mu, recorded by
vLLM) and trained at weights theta_old (the trainer's weights when the step starts):

    ratio_t  = pi_old(t) / mu(t)          both under the call's own sampling settings
    weight_t = min(ratio_t, is_cap)       truncated importance sampling (TIS)

and a transition is rejected (its tokens leave the loss and its denominator) when its ratios say
it came from too far away: any token below `veto` (the learner would almost never say it; this
includes a token now outside the learner's top-k/top-p set), or, by `mask`, a token ratio
(`token`: that token only), the sequence's product (`sequence`) or its geometric mean
(`geometric`, the default) outside [1/bound, bound]. The PPO ratio pi_theta/pi_old and its clip are
TRL's, on top. At zero staleness every ratio is 1 and nothing is truncated or rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trainer.config import OffPolicyMask as Mask

# Staleness buckets of the step's report, in versions of the lineage between sampling and training.
BUCKETS = ((0, 0, "0"), (1, 4, "1-4"), (5, 16, "5-16"), (17, 64, "17-64"), (65, None, "65+"))


def bucket_of(staleness: int) -> str:
    for low, high, name in BUCKETS:
        if staleness >= low and (high is None or staleness <= high):
            return name
    raise ValueError(staleness)


@dataclass
class Tally:
    """Completion tokens of a step by what the correction did to them."""

    tokens: int = 0
    truncated: int = 0  # weight capped at is_cap
    rejected: int = 0  # out of the loss


@dataclass
class Correction:
    weights_BT: torch.Tensor  # the truncated importance weight of each kept token (0 elsewhere)
    keep_BT: torch.Tensor  # 1 for tokens that stay in the loss
    by_staleness: dict[str, Tally] = field(default_factory=dict)
    ratio_min: float = 1.0
    ratio_max: float = 1.0
    weight_mean: float = 1.0


def correct(
    learner_BT: torch.Tensor,
    behaviour_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    staleness_B: Sequence[int],
    *,
    is_cap: float,
    mask: Mask,
    bound: float,
    veto: float,
) -> Correction:
    valid = mask_BT.bool()
    log_ratio = torch.where(valid, learner_BT - behaviour_BT, torch.zeros_like(learner_BT))
    log_ratio = log_ratio.clamp(-20.0, 20.0)  # exp() stays finite; far past any threshold
    ratio = log_ratio.exp()
    lo, hi = 1.0 / bound, bound
    keep = valid.clone()
    vetoed = ((ratio < veto) & valid).any(dim=-1, keepdim=True)
    keep &= ~vetoed
    if mask == "token":
        keep &= (ratio >= lo) & (ratio <= hi)
    elif mask in ("sequence", "geometric"):
        total = log_ratio.sum(dim=-1, keepdim=True)
        aggregate = (
            total if mask == "sequence" else total / valid.sum(-1, keepdim=True).clamp(min=1)
        )
        inside = (aggregate >= torch.log(torch.tensor(lo))) & (
            aggregate <= torch.log(torch.tensor(hi))
        )
        keep &= inside
    weights = torch.where(keep, ratio.clamp(max=is_cap), torch.zeros_like(ratio))
    out = Correction(weights_BT=weights, keep_BT=keep.to(mask_BT.dtype))
    truncated = keep & (ratio > is_cap)
    for b, staleness in enumerate(staleness_B):
        tally = out.by_staleness.setdefault(bucket_of(staleness), Tally())
        tally.tokens += int(valid[b].sum())
        tally.truncated += int(truncated[b].sum())
        tally.rejected += int((valid[b] & ~keep[b]).sum())
    if bool(valid.any()):
        out.ratio_min = float(ratio[valid].min())
        out.ratio_max = float(ratio[valid].max())
    if bool(keep.any()):
        out.weight_mean = float(weights[keep].mean())
    return out
