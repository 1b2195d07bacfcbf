"""One rank of `flywheel trainer` under torchrun, for
tests/trainer/learner/test_distributed_trainer.py.

    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/distributed_trainer_worker.py [--die-at-step RANK] trainer ARGS...

`--die-at-step RANK`: that rank kills itself (SIGKILL, nothing cleaned up) when rank 0 sends it
its first step, after the step's shards were dealt: a machine lost mid-step. `--fail-at-step
RANK`: that rank's step raises instead (a batch the step fails on).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from flywheel.cli import main
from trainer.learner.engine import Engine


def die(*_: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def fail(*_: Any) -> None:
    raise ValueError("this batch fails the step")


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] in (["--die-at-step"], ["--fail-at-step"]):
        if os.environ.get("RANK") == argv[1]:
            Engine.step = die if argv[0] == "--die-at-step" else fail  # type: ignore[method-assign]
        argv = argv[2:]
    main(argv)
