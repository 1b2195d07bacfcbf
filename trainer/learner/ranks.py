"""`flywheel trainer` on several processes: rank 0 leads, the others follow.

Under `torchrun` or `accelerate launch` every rank runs the same command. Rank 0 runs the trainer
exactly as one process does (`trainer/turns.py`): it alone reads and writes Postgres (claims,
leases, SIGTERM's release, the compare-and-set publish), talks to vLLM, serves metrics and saves
adapters. Its engines are `Led`: each call that changes an engine's state (build, step, snapshot,
restore, load) is first sent to the followers, which make the same call on their own copy
(`follow`), so every rank holds the same adapters and optimizer state. The promotion gate's
off-policy estimate deals its forward passes out the same way (`Led.score`, `Led.at`). A step
deals the claimed batch out (`trainer/distributed.shard`): each rank backpropagates its shard and
the gradients are averaged (the same step one process would take:
tests/trainer/learner/test_distributed.py), so rank 0's adapter, which it saves and publishes, is
every rank's. One version is published per step, by rank 0.

A rank that dies breaks the process group: rank 0's next collective raises, which becomes
`RanksLost`; the trainer stops as on SIGTERM (its claims go back at once, nothing is published)
and exits non-zero, for the launcher (torchrun's --max-restarts, a Job's backoff) to start the
group again. A step that raises, on rank 0 or on a follower, stops the group the same way (the
others may be inside the step's collectives), charging the batch an attempt (`StepFailed`), so a
batch that always fails (out of GPU memory on its longest shard, say) is set aside after
max_train_attempts as with one process. A follower tells rank 0 by leaving word under
`adapters_dir` before it exits (`failures_dir`): rank 0 cannot tell from the broken collective,
and under torchrun the launcher may SIGTERM rank 0 before its collective even fails. A rank that
dies without a word (killed, the host lost) charges nothing.

Followers need no database and no vLLM; they read adapters from `adapters_dir`, the path vLLM
already reads them from (shared storage across nodes).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from trainer.config import TrainerSettings
from trainer.data.batch import ModelLimits, Sample
from trainer.learner.distributed import Row, World, shard
from trainer.learner.engine import AtWeights, Engine, Snapshot, StepStats
from trainer.learner.scoring import Completion, Scorer
from trainer.learner.sft import Demo, SftStats

T = TypeVar("T")

log = logging.getLogger("flywheel.trainer")


class RanksLost(BaseException):
    """A collective with the other ranks failed: one of them is gone."""


class StepFailed(RanksLost):
    """The step raised on rank 0 while the others may be inside it: the ranks are out of step,
    so the group stops like on a lost rank (the launcher restarts it), and the batch is charged
    an attempt, as one process charges a batch that fails its step."""


def _send(command: tuple[Any, ...]) -> None:
    try:
        dist.broadcast_object_list([command], src=0)
    except RuntimeError as e:  # gloo: "Connection reset by peer"; NCCL: an error or abort
        raise RanksLost(f"a rank is gone ({e})") from e


class Led:
    """Rank 0's engine: the local Engine, each state change sent to the followers first."""

    def __init__(self, engine: Engine, world: World, failures: Path) -> None:
        self.engine, self.world, self.failures = engine, world, failures
        self.key = engine.adapter
        self._last: Snapshot | None = None  # the followers' snapshot (each keeps its last)

    @classmethod
    def build(
        cls,
        settings: TrainerSettings,
        resume_from: Path | None,
        *,
        base: Any | None = None,
        adapter: str = "default",
    ) -> Led:
        world = World.current()
        _send(("build", settings.lineage, adapter, base is not None, resume_from))
        try:
            engine = Engine(settings, resume_from=resume_from, base=base, adapter=adapter)
            return cls(engine, world, failures_dir(settings))
        except RuntimeError as e:
            raise RanksLost(f"building the engine with the other ranks failed ({e})") from e

    @property
    def adapter(self) -> str:
        return self.engine.adapter

    @property
    def limits(self) -> ModelLimits:
        return self.engine.limits

    @property
    def model(self) -> Any:
        return self.engine.model

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def step(self, samples: list[Sample]) -> StepStats:
        return self._dealt("step", self._shards(samples), self.engine.step)

    def sft_step(self, demos: list[Demo]) -> SftStats:
        return self._dealt("sft_step", self._shards(demos), self.engine.sft_step)

    def _shards(self, rows: list[Row]) -> list[list[Row]]:
        return [shard(rows, World(r, self.world.size)) for r in range(self.world.size)]

    def score(self, rows: Sequence[Completion]) -> list[float]:
        """Each row's log-probability under the weights now (the off-policy estimate's forward
        passes), the rows dealt out to every rank: a sharded base needs every rank in each
        forward pass, and a replicated one shares the work."""
        return self._scored(rows, None)

    def at(self, weights: Snapshot) -> Scorer:
        """A scorer under `weights`, which must be the last snapshot taken: each follower keeps
        only its last one (trainer/promotion.py's estimate is made against the `before` of the
        step or of the re-judging, nothing snapshotted since)."""
        if weights is not self._last:
            raise ValueError("the followers hold only the last snapshot rank 0 took")
        return _At(self, weights)

    def _scored(self, rows: Sequence[Completion], weights: Snapshot | None) -> list[float]:
        if not rows:
            return []
        size = self.world.size
        dealt = [list(rows[r::size]) for r in range(size)]
        each = len(dealt[0])  # the same count on every rank: a sharded base's passes must match
        padded = [mine + [rows[0]] * (each - len(mine)) for mine in dealt]
        local: Scorer = self.engine if weights is None else AtWeights(self.engine, weights)

        def score(mine: list[Completion]) -> list[list[float]]:
            gathered: list[Any] = [None] * size
            dist.gather_object(local.score(mine), gathered, dst=0)
            return gathered

        gathered = self._dealt("score", padded, score, weights is not None)
        out = [0.0] * len(rows)
        for r, scores in enumerate(gathered):
            for k, value in enumerate(scores[: len(dealt[r])]):
                out[r + k * size] = value
        return out

    def _dealt(self, command: str, shards: list[Any], work: Callable[[Any], T], *extra: Any) -> T:
        """Work on rows dealt out to every rank, one shard each (the followers make the same
        call on theirs)."""
        token = uuid.uuid4().hex  # where a follower whose work raises says so
        _send((command, self.key, token, *extra))
        mine: list[Any] = [None]
        what = "the estimate's scoring" if command == "score" else "the step"
        try:
            dist.scatter_object_list(mine, shards, src=0)
            return work(mine[0])
        except BaseException as e:  # the work did not finish on every rank
            lost = isinstance(e, dist.DistBackendError) or (
                isinstance(e, RuntimeError) and "peer" in str(e)
            )
            if isinstance(e, Exception) and not lost:
                raise StepFailed(f"{what} failed on rank 0 ({e!r})") from e
            # A follower gone: its step may have raised (it said so before exiting; the launcher
            # may have stopped this rank first), or it died (killed, out of memory on the host).
            said = self.failures / token
            if said.exists():
                reason = said.read_text()
                said.unlink()
                raise StepFailed(f"{what} failed on another rank ({reason})") from e
            if lost:
                raise RanksLost(f"a rank is gone mid-step ({e})") from e
            raise

    def snapshot(self) -> Snapshot:
        _send(("snapshot", self.key))
        self._last = self.engine.snapshot()
        return self._last

    def restore(self, snapshot: Snapshot) -> None:
        _send(("restore", self.key))  # each rank restores its own copy of the same snapshot
        self.engine.restore(snapshot)

    def load_adapter(self, adapter_dir: Path | None) -> None:
        _send(("load_adapter", self.key, adapter_dir))
        self.engine.load_adapter(adapter_dir)

    def save_adapter(self, out_dir: Path) -> None:
        self.engine.save_adapter(out_dir)  # the same weights on every rank: rank 0 writes


class _At:
    """Rank 0's scorer under the followers' last snapshot (`Led.at`)."""

    def __init__(self, led: Led, weights: Snapshot) -> None:
        self.led, self.weights = led, weights

    def score(self, rows: Sequence[Completion]) -> list[float]:
        return self.led._scored(rows, self.weights)


def led(
    settings: TrainerSettings, *, base: Any | None = None, adapter: str = "default"
) -> Callable[[Path | None], Any]:
    """A Trainer's `make_engine` on rank 0 of several."""
    return lambda resume: Led.build(settings, resume, base=base, adapter=adapter)


def follow(settings: TrainerSettings) -> None:
    """A follower's whole life: make rank 0's engine calls on its own engines until it stops."""
    engines: dict[str, Engine] = {}
    snapshots: dict[str, Snapshot] = {}
    base: Any = None
    log.info("rank %d following rank 0", World.current().rank)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        command, *args = box[0]
        if command == "stop":
            return
        if command == "build":
            lineage, adapter, on_base, resume = args
            engine = Engine(
                settings.for_lineage(lineage),
                resume_from=resume,
                base=base if on_base else None,
                adapter=adapter,
            )
            base = base if on_base else engine.model
            engines[adapter] = engine
            continue
        key = args[0]
        if command in ("step", "sft_step", "score"):
            mine: list[Any] = [None]
            dist.scatter_object_list(mine, None, src=0)
            try:
                if command == "score":  # at the last snapshot's weights, or at the weights now
                    own = engines[key]
                    local = AtWeights(own, snapshots[key]) if args[2] else own
                    dist.gather_object(local.score(mine[0]), None, dst=0)
                else:
                    getattr(engines[key], command)(mine[0])
            except Exception as e:  # the rows broke the work here: rank 0 says so
                said = failures_dir(settings) / args[1]
                said.parent.mkdir(parents=True, exist_ok=True)
                said.write_text(f"rank {World.current().rank}: {e!r}")
                raise
        elif command == "snapshot":
            snapshots[key] = engines[key].snapshot()
        elif command == "restore":
            engines[key].restore(snapshots[key])
        elif command == "load_adapter":
            try:
                engines[key].load_adapter(args[1])
            except ValueError as e:  # another LoRA configuration: rank 0 builds anew, next
                log.info("rank 0 will rebuild %s: %s", key, e)
        elif command != "heartbeat":
            raise ValueError(f"unknown command from rank 0: {command!r}")


def failures_dir(settings: TrainerSettings) -> Path:
    """Where a follower whose step raised leaves word for rank 0: the adapters' directory, which
    every machine shares."""
    return settings.adapters_dir / ".step-failures"


def heartbeat() -> None:
    """Once a turn, busy or idle: a command that does nothing, so followers waiting for the next
    one stay within the process group's timeout (rank_timeout_s), and a follower that died is
    found while rank 0 is idle or backing off."""
    _send(("heartbeat", ""))


def stop_followers() -> None:
    """Rank 0 is done: the followers return (nothing if they are gone already)."""
    with contextlib.suppress(RanksLost):
        _send(("stop", ""))
