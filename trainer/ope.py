"""Off-policy evaluation: the reward a candidate adapter would have earned on traffic already
logged, before any user sees it (docs/promotion.md says what is weighted, clipped and refused).

Each logged episode is its calls in order, each with the log-ratio of the candidate's probability
of the completion to the behaviour's (`log π(y|x) - log μ(y|x)`, summed over its tokens: the
recorded logprobs are μ's, `trainer/learner/logprobs.py` gives π's under the same sampling
settings), the reward the call earned on its own (its step rewards), and the episode's final
reward (earned after its last call). The estimand is the expected episode reward (final plus
step rewards) had the candidate served the episodes' tasks.

    wis  per-decision importance sampling, self-normalised: reward r_t weighted by the product of
         the ratios of the calls up to t (rho_t), clipped at `clip`, normalised per position
    dr   the same with a per-task baseline b(task, t) (the mean reward still to come from call t
         of that task's other episodes) as the direct model: weighted residuals r_t - b_t plus the
         baseline carried by the weights before t (Thomas & Brunskill's weighted doubly robust)

Every estimate is linear in how often each episode is counted, so a bootstrap is a matrix
product: `resamples` draws, percentile interval at `level`, the candidate and the current version
compared on the same draws (paired). `resample="episodes"` draws episodes; `"tasks"` draws tasks,
each with all its episodes (a cluster bootstrap): where a window holds few tasks many times each
(a GRPO group is one task asked G times), which tasks it happened to hold is most of what the
estimate could have been otherwise, and drawing episodes leaves that out. Too little overlap
(the effective sample size of the episodes' clipped weights under `min_ess`) refuses the
estimate rather than guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from trainer.config import OpeMethod as Method
from trainer.config import OpeResample as Resample

Array = npt.NDArray[np.float64]


@dataclass(frozen=True)
class LoggedEpisode:
    task: str
    rewards: tuple[float, ...]  # each call's own reward (its step rewards), in call order
    final: float  # the episode's final reward, earned after its last call

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ValueError("a logged episode has at least one call")


@dataclass(frozen=True)
class Estimate:
    value: float | None  # None: refused (`refused` says why)
    low: float | None
    high: float | None
    ess: float  # effective sample size of the episodes' clipped weights
    episodes: int
    refused: str | None = None
    # The mean of the episodes' clipped weights: about 1 when the logged traffic covers what the
    # policy says; far below, it mostly says what was never logged (self-normalising hides it).
    mean_weight: float = 1.0


@dataclass(frozen=True)
class Comparison:
    candidate: Estimate
    current: Estimate
    difference: Estimate  # candidate - current, its interval from the same resamples
    logged: float  # the mean reward the logged episodes earned (behaviour, no weights)


class Window:
    """Logged episodes packed for estimation: rewards (n, T) with the final reward on each
    episode's last call, the mask of real calls, and the per-task baseline of the reward still
    to come from each position (`_left_out_means`)."""

    def __init__(self, episodes: Sequence[LoggedEpisode]) -> None:
        if not episodes:
            raise ValueError("no logged episodes to estimate from")
        n, T = len(episodes), max(len(e.rewards) for e in episodes)
        self.n, self.T = n, T
        self.rewards = np.zeros((n, T))
        self.mask = np.zeros((n, T), dtype=bool)
        for i, e in enumerate(episodes):
            k = len(e.rewards)
            self.rewards[i, :k] = e.rewards
            self.rewards[i, k - 1] += e.final
            self.mask[i, :k] = True
        to_come = np.cumsum(self.rewards[:, ::-1], axis=1)[:, ::-1] * self.mask  # sum_{k>=t}
        tasks = [e.task for e in episodes]
        self.baseline = _left_out_means(to_come, self.mask, tasks)
        self.task_of = np.unique(np.array(tasks), return_inverse=True)[1].reshape(-1)
        self.logged = float(self.rewards.sum(axis=1).mean())

    def weights(self, log_ratios: Sequence[Sequence[float]], clip: float) -> Array:
        """rho (n, T): the product of each episode's ratios up to each call, clipped; past an
        episode's end its last value (it stays in every later position's normaliser)."""
        L = np.zeros((self.n, self.T))
        for i, lr in enumerate(log_ratios):
            calls = int(self.mask[i].sum())
            if len(lr) != calls:
                raise ValueError(f"episode {i}: {len(lr)} log-ratios for {calls} calls")
            L[i, : len(lr)] = lr
        if not np.all(np.isfinite(L)):
            raise ValueError("a log-ratio is not finite")
        return np.asarray(np.exp(np.minimum(np.cumsum(L, axis=1), np.log(clip))))


def estimate(
    window: Window,
    log_ratios: Sequence[Sequence[float]],
    *,
    method: Method = "dr",
    clip: float = 10.0,
    min_ess: float = 30.0,
    resamples: int = 1000,
    level: float = 0.9,
    seed: int = 0,
    resample: Resample = "episodes",
) -> Estimate:
    """The episode reward the policy whose log-ratios these are would have earned."""
    rho = window.weights(log_ratios, clip)
    counts = _counts(window, resamples, seed, resample)
    return _estimate(window, rho, counts, method, min_ess, level)[0]


def compare(
    window: Window,
    candidate: Sequence[Sequence[float]],
    current: Sequence[Sequence[float]],
    *,
    method: Method = "dr",
    clip: float = 10.0,
    min_ess: float = 30.0,
    resamples: int = 1000,
    level: float = 0.9,
    seed: int = 0,
    resample: Resample = "episodes",
) -> Comparison:
    """The candidate against the current version on the same logged episodes and resamples."""
    counts = _counts(window, resamples, seed, resample)
    rho_cand, rho_cur = window.weights(candidate, clip), window.weights(current, clip)
    cand, cand_draws = _estimate(window, rho_cand, counts, method, min_ess, level)
    cur, cur_draws = _estimate(window, rho_cur, counts, method, min_ess, level)
    ess = min(cand.ess, cur.ess)
    if cand.value is None or cur.value is None or cand_draws is None or cur_draws is None:
        diff = Estimate(None, None, None, ess, window.n, cand.refused or cur.refused)
    else:  # the same resamples: the difference's draws pair up
        low, high = _interval(cand_draws - cur_draws, level)
        diff = Estimate(cand.value - cur.value, low, high, ess, window.n)
    return Comparison(cand, cur, diff, window.logged)


def effective_sample_size(rho: Array) -> float:
    """Kish's (sum w)^2 / sum w^2 of each episode's whole (clipped) weight."""
    w = rho[:, -1]
    return float(w.sum() ** 2 / max(float((w * w).sum()), 1e-300))


def _estimate(
    window: Window, rho: Array, counts: Array, method: Method, min_ess: float, level: float
) -> tuple[Estimate, Array | None]:
    """The estimate, and its value on each resample (None: refused)."""
    ess, mean_weight = effective_sample_size(rho), float(rho[:, -1].mean())
    if ess < min_ess:
        why = (
            f"not enough overlap: the effective sample size of {window.n} episodes is "
            f"{ess:.1f}, under the {min_ess:g} needed"
        )
        return Estimate(None, None, None, ess, window.n, why, mean_weight), None
    ones = np.ones((1, window.n))
    value = float(_values(window, rho, ones, method)[0])
    draws = _values(window, rho, counts, method)
    low, high = _interval(draws, level)
    return Estimate(value, low, high, ess, window.n, mean_weight=mean_weight), draws


def _values(window: Window, rho: Array, counts: Array, method: Method) -> Array:
    """The estimate for each row of `counts` (how often each episode is drawn): (B,)."""
    denominator = counts @ rho  # (B, T)
    value = _normalised(counts @ (rho * window.rewards), denominator).sum(axis=1)
    if method == "wis":
        return np.asarray(value)
    b = window.baseline
    before = np.concatenate([np.ones((window.n, 1)), rho[:, :-1]], axis=1)  # rho_{t-1}, rho_0 = 1
    value -= _normalised(counts @ (rho * b), denominator).sum(axis=1)
    value += _normalised(counts @ (before * b), counts @ before).sum(axis=1)
    return np.asarray(value)


def _normalised(weighted: Array, denominator: Array) -> Array:
    """weighted / denominator, 0 where no drawn episode has weight at a position: a resample
    of only episodes the policy would never have produced (their weights underflow to 0) says
    nothing about that position (wis adds nothing, dr keeps its baseline) rather than NaN."""
    out = np.zeros_like(weighted)
    np.divide(weighted, denominator, out=out, where=denominator > 0)
    return out


def _left_out_means(to_come: Array, mask: npt.NDArray[np.bool_], tasks: list[str]) -> Array:
    """b(e, t): the mean reward still to come from call t of the *other* episodes of e's task
    (of every other episode, where its task has none). Left out, an episode's own reward never
    predicts itself: with one episode a task (a window of many tasks), an in-sample mean would
    equal the episode's reward and cancel its weight, pulling the estimate to the logged mean."""
    seen = mask.astype(np.float64)
    total, count = to_come.sum(axis=0), seen.sum(axis=0)
    everyone = np.where(count > 1, (total - to_come) / np.maximum(count - 1, 1), 0.0)
    baseline = np.zeros_like(to_come)
    names = np.array(tasks)
    for task in np.unique(names):
        rows = names == task
        mine, n = to_come[rows].sum(axis=0), seen[rows].sum(axis=0)
        others = n - seen[rows]  # the task's other episodes with a call t
        own = (mine - to_come[rows]) / np.maximum(others, 1)
        baseline[rows] = np.where(others > 0, own, everyone[rows]) * seen[rows]
    return baseline


def _counts(window: Window, resamples: int, seed: int, resample: Resample) -> Array:
    """(resamples, n): how many times each episode is in each bootstrap draw: drawn itself, or
    as often as its task is drawn (as many draws as the window has tasks)."""
    rng = np.random.default_rng(seed)
    units = window.n if resample == "episodes" else int(window.task_of.max()) + 1
    drawn = rng.integers(0, units, size=(resamples, units))
    counts = np.zeros((resamples, units))
    np.add.at(counts, (np.arange(resamples)[:, None], drawn), 1.0)
    return counts if resample == "episodes" else counts[:, window.task_of]


def _interval(draws: Array, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2
    low, high = np.quantile(draws, [tail, 1 - tail])
    return float(low), float(high)
