"""One rank of tests/trainer/learner/test_distributed.py, started by torchrun: each loss type's
step on this
rank's shard of the test batch, its averaged gradient and adapter written for the test to read.

    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/distributed_worker.py OUT_DIR MICRO_BATCH_TOKENS SHARD_BASE LOSS_TYPE [LOSS_TYPE ...]

SHARD_BASE 1: the base model sharded over the ranks with FSDP2 (`shard_base`); each rank also
writes how many of the base's weights it holds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.trainer.learner.test_microbatch import (
    demonstrations,
    gradient_of_one_sft_step,
    gradient_of_one_step,
    samples,
    settings_for,
)
from trainer.learner.distributed import World, base_held, end, join, shard
from trainer.learner.engine import Engine
from trainer.learner.scoring import Completion


def main() -> None:
    out, micro, sharded = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    loss_types = sys.argv[4:]
    join()  # as `flywheel trainer` does first
    for loss_type in loss_types:
        world = World.current()
        home = out / f"{loss_type}-rank{world.rank}"
        settings = settings_for(
            home, loss_type=loss_type, micro_batch_tokens=micro, shard_base=sharded
        )
        engine = Engine(settings)
        world = engine.world  # the process group TRL's Accelerator joined
        batch = samples(engine, stale=True)
        mine = shard(batch, world)
        rows = [-1 if s.ballast else next(i for i, b in enumerate(batch) if b is s) for s in mine]
        grads, stats = gradient_of_one_step(engine, mine)
        tally = {k: vars(t) for k, t in stats.by_staleness.items()}
        report = {
            "loss": stats.loss,
            "tally": tally,
            "ratio": [stats.is_ratio_min, stats.is_ratio_max],
        }
        weights = {n: p.detach().clone() for n, p in engine.model.named_parameters() if n in grads}
        held, total = base_held(engine.model)
        torch.save(
            {"world": world.size, "rows": rows, "grads": grads, "weights": weights}
            | {"base_held": held, "base_total": total}
            | report,
            out / f"{loss_type}-rank{world.rank}.pt",
        )
    # a supervised step on demonstrations, from known weights, dealt out the same way
    fill(engine)
    sft_grads, sft_stats = gradient_of_one_sft_step(engine, shard(demonstrations(), world))
    torch.save(
        {"grads": sft_grads, "loss": sft_stats.loss, "tokens": sft_stats.tokens},
        out / f"sft-rank{world.rank}.pt",
    )
    # another lineage's adapter on the last engine's base, added after it was built (sharded)
    second = engine.beside(settings, "second", None)
    fill(second)
    grads, stats = gradient_of_one_step(second, shard(samples(second, stale=True), world))
    plain = all(
        type(p) is torch.nn.Parameter for n, p in second.model.named_parameters() if second._own(n)
    )
    torch.save(
        {"grads": grads, "loss": stats.loss, "plain": plain, "loss_type": loss_types[-1]},
        out / f"second-rank{world.rank}.pt",
    )
    # the promotion gate's scoring (forward passes without gradient), rank 0 alone saving the
    # adapter, then a step: FSDP2's units must be alike on the ranks again (`reshard`)
    fill(second)
    batch = samples(second, stale=True)
    scores = second.score([Completion(s.prompt_ids, s.completion_ids, s.sampling) for s in batch])
    if world.leader:
        second.save_adapter(out / "saved")
    grads, _ = gradient_of_one_step(second, shard(batch, world))
    torch.save({"scores": scores, "grads": grads}, out / f"scored-rank{world.rank}.pt")
    end()  # leaves the group, skips the interpreter's finalization (trainer/learner/distributed.py)


def fill(engine: Engine) -> None:
    """The engine's adapter set to the same weights in any process (a new adapter's draw
    depends on what the process drew before)."""
    draw = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(engine.model.named_parameters(), key=lambda np: np[0]):
            if engine._own(name):
                p.copy_(0.05 * torch.randn(p.shape, generator=draw))


if __name__ == "__main__":
    main()
