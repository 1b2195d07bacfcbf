"""The off-policy estimators (trainer/ope.py) on synthetic logged traffic whose answer is known
exactly: a behaviour policy μ logged episodes, a different target π is evaluated from them, and
the estimate must find π's true value where the logged mean (μ's value; what an estimator that
ignores the weights reports) is far from it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.ope import LoggedEpisode, Window, compare, estimate

TASKS, ACTIONS = 4, 5


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return np.asarray(e / e.sum(axis=-1, keepdims=True))


class World:
    """Two-call episodes: call 1 picks a1 given the task (step reward r1 ~ p1[x, a1]), call 2
    picks a2 given (task, a1) (final reward ~ p2[x, a1, a2]). One-call episodes: the final
    reward is p1[x, a1]'s draw, no step reward."""

    def __init__(self, seed: int, *, calls: int) -> None:
        rng = np.random.default_rng(seed)
        self.calls = calls
        self.p1 = rng.uniform(0, 1, (TASKS, ACTIONS))
        self.p2 = rng.uniform(0, 1, (TASKS, ACTIONS, ACTIONS))
        self.mu1 = softmax(rng.normal(0, 0.5, (TASKS, ACTIONS)))
        self.mu2 = softmax(rng.normal(0, 0.5, (TASKS, ACTIONS, ACTIONS)))
        # The target leans toward the better actions: its value is well above the behaviour's.
        self.pi1 = softmax(np.log(self.mu1) + 1.5 * self.p1)
        self.pi2 = softmax(np.log(self.mu2) + 1.5 * self.p2)

    def value(self, first: np.ndarray, second: np.ndarray) -> float:
        if self.calls == 1:
            return float((first * self.p1).sum(axis=1).mean())
        then = (second * self.p2).sum(axis=2)  # (x, a1): expected final reward
        return float((first * (self.p1 + then)).sum(axis=1).mean())

    def log(
        self, n: int, seed: int
    ) -> tuple[list[LoggedEpisode], list[list[float]], list[list[float]]]:
        """n episodes under μ: the episodes, π's log-ratios, and μ's own (all zero)."""
        rng = np.random.default_rng(seed)
        episodes, ratios, zeros = [], [], []
        for _ in range(n):
            x = int(rng.integers(TASKS))
            a1 = int(rng.choice(ACTIONS, p=self.mu1[x]))
            r1 = float(rng.random() < self.p1[x, a1])
            lr = [math.log(self.pi1[x, a1] / self.mu1[x, a1])]
            if self.calls == 1:
                episodes.append(LoggedEpisode(f"t{x}", (0.0,), r1))
            else:
                a2 = int(rng.choice(ACTIONS, p=self.mu2[x, a1]))
                final = float(rng.random() < self.p2[x, a1, a2])
                lr.append(math.log(self.pi2[x, a1, a2] / self.mu2[x, a1, a2]))
                episodes.append(LoggedEpisode(f"t{x}", (r1, 0.0), final))
            ratios.append(lr)
            zeros.append([0.0] * len(lr))
        return episodes, ratios, zeros


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("method", ["wis", "dr"])
def test_the_estimate_finds_the_targets_value_where_the_logged_mean_does_not(
    calls: int, method: str
) -> None:
    world = World(0, calls=calls)
    truth, behaviour = world.value(world.pi1, world.pi2), world.value(world.mu1, world.mu2)
    assert truth - behaviour > 0.1  # the weights matter here
    episodes, ratios, zeros = world.log(4000, seed=1)
    window = Window(episodes)
    got = estimate(window, ratios, method=method, clip=50.0, resamples=400)  # type: ignore[arg-type]
    assert got.value is not None and got.low is not None and got.high is not None
    assert abs(got.value - truth) < 0.03, (got, truth)
    assert got.low <= truth <= got.high
    # What ignoring the weights gives: the behaviour's value, and an interval far from the truth.
    ignored = estimate(window, zeros, method=method, resamples=400)  # type: ignore[arg-type]
    assert ignored.value == pytest.approx(window.logged)
    assert abs(ignored.value - truth) > 0.08 and ignored.high is not None and ignored.high < truth


def test_a_window_of_many_tasks_with_an_episode_or_two_each_is_still_estimated() -> None:
    # A real window: the agent's questions rarely repeat in it. A task's baseline fitted on its
    # own episode would equal that episode's reward, cancel its weight and give the logged mean.
    rng = np.random.default_rng(11)
    tasks = 2000
    p = rng.uniform(0, 1, (tasks, ACTIONS))
    mu = softmax(rng.normal(0, 0.5, (tasks, ACTIONS)))
    pi = softmax(np.log(mu) + 2.0 * p)
    truth = float((pi * p).sum(axis=1).mean())
    logged = float((mu * p).sum(axis=1).mean())
    episodes, ratios = [], []
    for _ in range(1000):
        x = int(rng.integers(tasks))
        a = int(rng.choice(ACTIONS, p=mu[x]))
        episodes.append(LoggedEpisode(f"t{x}", (0.0,), float(rng.random() < p[x, a])))
        ratios.append([math.log(pi[x, a] / mu[x, a])])
    got = estimate(Window(episodes), ratios, clip=50.0, resamples=200)
    assert got.value is not None and abs(got.value - truth) < 0.03, (got.value, truth, logged)
    assert truth - logged > 0.1


def test_the_interval_covers_the_truth_about_as_often_as_its_level() -> None:
    world = World(2, calls=2)
    truth = world.value(world.pi1, world.pi2)
    covered = 0
    for run in range(40):
        episodes, ratios, _ = world.log(600, seed=100 + run)
        got = estimate(Window(episodes), ratios, clip=50.0, resamples=300, level=0.9, seed=run)
        assert got.low is not None and got.high is not None
        covered += got.low <= truth <= got.high
    assert covered >= 30, covered  # 0.9 nominal; 40 runs


@pytest.mark.parametrize("method", ["wis", "dr"])
def test_drawing_tasks_covers_a_window_of_few_tasks_asked_many_times(method: str) -> None:
    # Traffic as GRPO's groups make it: each window holds 12 tasks of a large population, each
    # asked 8 times, and tasks differ far more than their episodes do. Which 12 tasks a window
    # happened to hold is most of its error; drawing episodes leaves that out of the interval.
    rng = np.random.default_rng(5)
    population, per_window, group, runs = 5000, 12, 8, 80
    base = rng.uniform(0.05, 0.95, population)
    p = np.clip(base[:, None] + rng.normal(0, 0.1, (population, ACTIONS)), 0, 1)
    mu = softmax(rng.normal(0, 0.5, (population, ACTIONS)))
    pi = softmax(np.log(mu) + 2.0 * p)
    truth = float((pi * p).sum(axis=1).mean())
    covered = {"episodes": 0, "tasks": 0}
    for run in range(runs):
        episodes, ratios = [], []
        for x in rng.choice(population, per_window, replace=False):
            for _ in range(group):
                a = int(rng.choice(ACTIONS, p=mu[x]))
                episodes.append(LoggedEpisode(f"t{x}", (0.0,), float(rng.random() < p[x, a])))
                ratios.append([math.log(pi[x, a] / mu[x, a])])
        window = Window(episodes)
        for resample in covered:
            got = estimate(
                window, ratios, method=method, clip=50.0, resamples=300, min_ess=10,  # type: ignore[arg-type]
                level=0.9, seed=run, resample=resample,  # type: ignore[arg-type]
            )  # fmt: skip
            assert got.low is not None and got.high is not None
            covered[resample] += got.low <= truth <= got.high
    assert covered["tasks"] >= 0.8 * runs, covered  # 0.9 nominal
    assert covered["episodes"] <= 0.75 * runs, covered


def test_the_doubly_robust_estimate_varies_less_when_tasks_differ_in_reward() -> None:
    # Rewards with a large per-task part (0, 1, 2, 3) and a small part the action decides; each
    # sample has the same task mix, so what varies is the weights: under WIS they move the
    # tasks' shares of the estimate, under DR only the residuals around each task's baseline.
    rng = np.random.default_rng(3)
    p = rng.uniform(0, 1, (TASKS, ACTIONS))
    level = np.arange(TASKS, dtype=float)[:, None]
    mu = softmax(rng.normal(0, 0.5, (TASKS, ACTIONS)))
    pi = softmax(np.log(mu) + 3 * p)
    truth = float((pi * (level + p)).sum(axis=1).mean())
    spread = {}
    for method in ("wis", "dr"):
        values = []
        for run in range(30):
            draw = np.random.default_rng(200 + run)
            episodes, ratios = [], []
            for i in range(300):
                x = i % TASKS
                a = int(draw.choice(ACTIONS, p=mu[x]))
                episodes.append(LoggedEpisode(f"t{x}", (0.0,), float(level[x, 0] + p[x, a])))
                ratios.append([math.log(pi[x, a] / mu[x, a])])
            got = estimate(Window(episodes), ratios, method=method, clip=50.0, resamples=10)  # type: ignore[arg-type]
            assert got.value is not None
            values.append(got.value)
        assert abs(float(np.mean(values)) - truth) < 0.02, method
        spread[method] = float(np.std(values))
    assert spread["dr"] < 0.7 * spread["wis"], spread


def test_too_little_overlap_is_refused_not_guessed() -> None:
    # The target always picks the action the behaviour picks once in a thousand.
    episodes = [LoggedEpisode("t", (0.0,), float(i % 2)) for i in range(500)]
    rare = [[math.log(1 / 0.001)] if i == 0 else [math.log(1e-6)] for i in range(500)]
    got = estimate(Window(episodes), rare, min_ess=30)
    assert got.value is None and got.refused is not None and "not enough overlap" in got.refused
    assert got.ess < 30


@pytest.mark.parametrize("method", ["wis", "dr"])
def test_a_resample_of_only_weightless_episodes_is_no_nan(method: str) -> None:
    # What CI met on a real step: episodes the candidate would never produce (their
    # weights underflow to 0), six of eight here, so some resamples draw only those and
    # normalise by 0.
    episodes = [LoggedEpisode(f"t{i % 3}", (0.0, 0.0), float(i % 2)) for i in range(8)]
    ratios = [[0.0, 0.0] if i < 2 else [-800.0, 0.0] for i in range(8)]  # exp(-800) == 0.0
    with np.errstate(divide="raise", invalid="raise"):
        got = estimate(Window(episodes), ratios, method=method, min_ess=1, resamples=2000)  # type: ignore[arg-type]
    assert got.value is not None and got.low is not None and got.high is not None
    assert all(math.isfinite(v) for v in (got.value, got.low, got.high))
    assert got.low <= got.value <= got.high


def test_the_mean_weight_tells_a_policy_that_says_what_was_never_logged() -> None:
    # Self-normalised, a policy that gives every logged answer a thousandth of the behaviour's
    # probability looks like the behaviour; its mean weight says where its mass went.
    episodes = [LoggedEpisode("t", (0.0,), float(i % 2)) for i in range(200)]
    elsewhere = estimate(Window(episodes), [[math.log(1e-3)]] * 200)
    assert elsewhere.value == pytest.approx(0.5) and elsewhere.mean_weight == pytest.approx(1e-3)
    world = World(0, calls=2)
    logged, ratios, _ = world.log(3000, seed=9)
    assert estimate(Window(logged), ratios, clip=50.0, resamples=10).mean_weight == pytest.approx(
        1.0, abs=0.1
    )


def test_compare_pairs_the_candidate_with_the_current_version() -> None:
    world = World(4, calls=2)
    episodes, ratios, zeros = world.log(2000, seed=5)
    window = Window(episodes)
    c = compare(window, ratios, zeros, clip=50.0, resamples=400)
    truth = world.value(world.pi1, world.pi2) - world.value(world.mu1, world.mu2)
    assert c.current.value == pytest.approx(c.logged)
    assert c.difference.value == pytest.approx(c.candidate.value - c.current.value)  # type: ignore[operator]
    assert c.difference.low is not None and c.difference.high is not None
    assert c.difference.low <= truth <= c.difference.high
    assert c.difference.low > 0  # the better candidate is told apart
    # Paired draws: the difference's interval is narrower than the sum of the two half-widths.
    widths = [e.high - e.low for e in (c.candidate, c.current)]  # type: ignore[operator]
    assert c.difference.high - c.difference.low < sum(widths)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("abc"),
            st.lists(st.floats(-1, 1), min_size=1, max_size=3),
            st.floats(-1, 1),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_the_behaviour_evaluated_on_its_own_traffic_is_the_logged_mean(
    rows: list[tuple[str, list[float], float]],
) -> None:
    episodes = [LoggedEpisode(task, tuple(rewards), final) for task, rewards, final in rows]
    zeros = [[0.0] * len(rewards) for _, rewards, _ in rows]
    window = Window(episodes)
    mean = sum(sum(r) + f for _, r, f in rows) / len(rows)
    for method in ("wis", "dr"):
        got = estimate(window, zeros, method=method, min_ess=0, resamples=20)  # type: ignore[arg-type]
        assert got.value == pytest.approx(mean, abs=1e-9)
        assert got.ess == pytest.approx(len(rows))


def test_bad_input_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="at least one call"):
        LoggedEpisode("t", (), 1.0)
    with pytest.raises(ValueError, match="no logged episodes"):
        Window([])
    window = Window([LoggedEpisode("t", (0.0, 0.0), 1.0)])
    with pytest.raises(ValueError, match="2 calls"):
        estimate(window, [[0.0]], min_ess=0)
    with pytest.raises(ValueError, match="not finite"):
        estimate(window, [[0.0, math.nan]], min_ess=0)
