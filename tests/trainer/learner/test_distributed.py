"""One lineage's step on 2 processes (torchrun, gloo) is the step one process takes.

The same claimed batch, trained by one process and by two (each its shard, gradients averaged:
trainer/learner/distributed.py), the base model replicated on both or sharded over them (FSDP2, each
holding half its weights): the same averaged LoRA gradient (max abs difference <= 1e-5 of its
largest entry), for dapo (its global token count), grpo and bnpo, with micro-batches; the same
loss; the same adapter after the step to float32 rounding; and every row trained by exactly one
rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from tests.distributed_worker import fill
from tests.trainer.learner.test_microbatch import (
    demonstrations,
    gradient_of_one_sft_step,
    gradient_of_one_step,
    samples,
    settings_for,
)
from trainer.data.batch import Sample
from trainer.data.sampling import Sampling
from trainer.learner.distributed import World, shard
from trainer.learner.engine import Engine
from trainer.learner.scoring import Completion

ROOT = Path(__file__).resolve().parents[3]
LOSS_TYPES = ["dapo", "grpo", "bnpo"]
MICRO = 14  # tokens: pieces of 1-3 rows; alone, one rank would cut 3 and the other 2

# One worker runs them all: each mode's two ranks start once (a module fixture is built per
# worker that runs any of its tests, ~30 s a build).
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("two-ranks")]


class Ranks(NamedTuple):
    sharded: bool
    out: Path
    by_loss: dict[str, list[dict[str, Any]]]  # each rank's report, by loss type


@pytest.fixture(scope="module", params=["replicated", "sharded"])
def two_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Ranks:
    """Each rank's step; the base model replicated on both, or sharded over them (FSDP2)."""
    sharded = "1" if request.param == "sharded" else "0"
    out = tmp_path_factory.mktemp("ranks")
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    run = subprocess.run(
        [
            *(
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
            ),
            *(
                # as a module from the root: run as a script, tests/ would come first on
                # sys.path and its folders (tests/fakes/, ...) hide the packages they mirror
                "-m",
                "tests.distributed_worker",
                str(out),
                str(MICRO),
                sharded,
                *LOSS_TYPES,
            ),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return Ranks(
        request.param == "sharded",
        out,
        {
            t: [torch.load(out / f"{t}-rank{r}.pt", weights_only=True) for r in range(2)]
            for t in LOSS_TYPES
        },
    )


def largest_entry(grads: dict[str, torch.Tensor]) -> float:
    largest = max(float(g.abs().max()) for g in grads.values())
    assert largest > 0
    return largest


def assert_same_gradients(theirs: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
    """A rank's gradients are one process's, within float32 rounding of the largest entry."""
    largest = largest_entry(grads)
    assert theirs.keys() == grads.keys()
    worst = max(float((theirs[n] - grads[n]).abs().max()) for n in grads)
    assert worst <= 1e-5 * largest, (worst, largest)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.slow
def test_two_processes_take_one_processs_step(
    loss_type: str, two_ranks: Ranks, tmp_path: Path
) -> None:
    alone = Engine(settings_for(tmp_path, loss_type=loss_type))
    lr = alone.trainer.args.learning_rate
    batch = samples(alone, stale=True)
    grads, stats = gradient_of_one_step(alone, batch)
    after = {n: p.detach() for n, p in alone.model.named_parameters() if n in grads}
    ranks = two_ranks.by_loss[loss_type]
    assert [r["world"] for r in ranks] == [2, 2]  # really two processes in one group
    largest = largest_entry(grads)
    for rank in ranks:
        assert_same_gradients(rank["grads"], grads)
        assert rank["loss"] == pytest.approx(stats.loss, rel=1e-5, abs=1e-7)
        # the step's report counts every rank's tokens, not the reporting rank's
        assert rank["tally"] == {k: vars(t) for k, t in stats.by_staleness.items()}
        assert rank["ratio"] == pytest.approx([stats.is_ratio_min, stats.is_ratio_max], rel=1e-5)
        # Adam's first step moves each weight by lr * g / (|g| + eps): where |g| is near eps,
        # float32 rounding of g (the two processes add in another order) moves the weight by a
        # share of a step. Entries with a real gradient within 1 % of a step; every entry within
        # one step, and in the direction its gradient says.
        for n, w in after.items():
            moved, real = rank["weights"][n] - w, grads[n].abs() > 1e-4 * largest
            assert float((moved * real).abs().max()) <= 0.01 * lr, n
            assert float(moved.abs().max()) <= lr, n
    held = [rank["base_held"] for rank in ranks]
    if two_ranks.sharded:  # each rank holds its part of the base model's weights
        assert sum(held) == ranks[0]["base_total"] and max(held) < 0.6 * sum(held)
    else:
        assert held == [r["base_total"] for r in ranks]
    for n in after:  # the replicas themselves are identical
        assert torch.equal(ranks[0]["weights"][n], ranks[1]["weights"][n])
    # every row on exactly one rank; the odd one out topped up with ballast
    rows = [i for rank in ranks for i in rank["rows"]]
    assert sorted(i for i in rows if i >= 0) == list(range(len(batch)))
    assert rows.count(-1) == 1 and len(ranks[0]["rows"]) == len(ranks[1]["rows"])


def test_a_supervised_step_on_two_processes_is_one_processs(
    two_ranks: Ranks, tmp_path: Path
) -> None:
    """Demonstrations dealt out like a GRPO batch (the pieces cut alike on both ranks, which
    FSDP2's forward passes need): the same gradient, loss and answer tokens as one process."""
    ranks = [torch.load(two_ranks.out / f"sft-rank{r}.pt", weights_only=True) for r in (0, 1)]
    alone = Engine(settings_for(tmp_path, loss_type=LOSS_TYPES[-1], micro_batch_tokens=MICRO))
    fill(alone)
    grads, stats = gradient_of_one_sft_step(alone, demonstrations())
    for rank in ranks:
        assert_same_gradients(rank["grads"], grads)
        assert rank["loss"] == pytest.approx(stats.loss, rel=1e-5)
        assert rank["tokens"] == stats.tokens


def test_another_lineage_added_later_takes_one_processs_step(
    two_ranks: Ranks, tmp_path: Path
) -> None:
    """A second adapter on the same base, added after the engine was built (FSDP2 had sharded
    the base by then): its step on 2 ranks is one process's, and it is an ordinary parameter."""
    ranks = [torch.load(two_ranks.out / f"second-rank{r}.pt", weights_only=True) for r in (0, 1)]
    alone = Engine(settings_for(tmp_path, loss_type=ranks[0]["loss_type"]))
    second = alone.beside(alone.trainer.settings, "second", None)
    fill(second)
    grads, stats = gradient_of_one_step(second, samples(second, stale=True))
    assert grads and all(".second." in n for n in grads)
    largest = max(float(g.abs().max()) for g in grads.values())
    for rank in ranks:
        assert rank["plain"] and rank["grads"].keys() == grads.keys()
        worst = max(float((rank["grads"][n] - grads[n]).abs().max()) for n in grads)
        assert worst <= 1e-5 * largest, (worst, largest)
        assert rank["loss"] == pytest.approx(stats.loss, rel=1e-5, abs=1e-7)


def test_the_gates_scoring_is_one_processs_and_a_step_follows_it(
    two_ranks: Ranks, tmp_path: Path
) -> None:
    """Forward passes without gradient (the promotion gate's off-policy scoring,
    trainer/learner/ranks.py `Led.score`) on both ranks give one process's log-probabilities;
    then rank 0 alone saves the adapter and the ranks take a step. A sharded base's forward
    pass without gradient left the root unit's weights gathered and the save regathered rank
    0's alone: the next step's collectives no longer matched (`reshard`)."""
    ranks = [torch.load(two_ranks.out / f"scored-rank{r}.pt", weights_only=True) for r in (0, 1)]
    alone = Engine(settings_for(tmp_path, loss_type=LOSS_TYPES[-1]))
    second = alone.beside(alone.trainer.settings, "second", None)
    fill(second)
    batch = samples(second, stale=True)
    scores = second.score([Completion(s.prompt_ids, s.completion_ids, s.sampling) for s in batch])
    for rank in ranks:
        assert rank["scores"] == pytest.approx(scores, rel=1e-5)
        assert rank["grads"] and all(g.abs().max() > 0 for g in rank["grads"].values())


def test_one_rank_alone_would_not_take_that_step(two_ranks: Ranks, tmp_path: Path) -> None:
    """Without the all-reduce a rank steps on its own shard: the comparison above can fail."""
    alone = Engine(settings_for(tmp_path, loss_type="dapo"))
    grads, _ = gradient_of_one_step(alone, shard(samples(alone, stale=True), World(0, 2)))
    theirs = two_ranks.by_loss["dapo"][0]["grads"]
    largest = max(float(g.abs().max()) for g in theirs.values())
    assert max(float((theirs[n] - grads[n]).abs().max()) for n in grads) > 1e-3 * largest


def sample(prompt: int, completion: int) -> Sample:
    return Sample([1] * prompt, [2] * completion, [-1.0] * completion, 0.0, 0.0, Sampling(), 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shards_cover_a_batch_once_in_equal_row_counts(world: int) -> None:
    batch = [sample(p, c) for p, c in [(5, 3), (1, 1), (9, 2), (2, 8), (4, 4), (3, 1), (7, 7)]]
    shards = [shard(batch, World(r, world)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) >= 1
    real = [s for rows in shards for s in rows if not s.ballast]
    assert sorted(map(id, real)) == sorted(map(id, batch))  # no duplicate, no gap
    tokens = [
        sum(len(s.prompt_ids) + len(s.completion_ids) for s in rows if not s.ballast)
        for rows in shards
    ]
    if world == 2:
        assert max(tokens) - min(tokens) <= 14  # longest first, dealt in turn
    with pytest.raises(ValueError, match="empty"):
        shard([], World(0, world))
