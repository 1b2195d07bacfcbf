"""The warm-started models the e2e tests train, by name, under TEST_HOME/models.

Each takes minutes of one core to build (demo/calculator.py, demo/calc_tools_model.py,
demo/sql_model.py), so a test that needs one is marked `@pytest.mark.models(name)`: conftest runs
such tests last and builds their models in a background process from the session's start, on the
core the other tests leave idle. The builders hold a lock on their directory, so a test that
needs its model before the background build is done waits for it rather than building it again.

    python -m tests.models calculator sql calc-tools     # what conftest starts (niced)
    python -m tests.models                               # all of them: make test, during lint
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from demo.stack import TASKS
from fakes.processes import build_frameworks_venv, build_litellm_venv
from tests.conftest import TEST_HOME
from trainer.models import packaged


def _built_by(builder: Callable[[Path], Path] | None) -> Callable[[Path], Path]:
    assert builder is not None
    return builder


def _smollm2(out_dir: Path) -> Path:
    """The packaged SmolLM2-135M-Instruct, converted (trainer/models.py) under TEST_HOME."""
    assert out_dir == path("smollm2-135m")
    return packaged("smollm2-135m", TEST_HOME)


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "calculator": _built_by(TASKS["calc"].build_model),
    "calc-tools": _built_by(TASKS["calc-tools"].build_model),
    "sql": _built_by(TASKS["sql"].build_model),
    "smollm2-135m": _smollm2,  # a real model (issue 41): a minute to convert
    "litellm-venv": build_litellm_venv,  # the judge's and routed proxies' install (openai 2)
    "frameworks-venv": build_frameworks_venv,  # DSPy, CrewAI, LlamaIndex over litellm-venv
}


def path(name: str) -> Path:
    return TEST_HOME / "models" / name


def built(name: str) -> Path:
    """The model's directory, built (or waited for) first."""
    return BUILDERS[name](path(name))


if __name__ == "__main__":
    for name in sys.argv[1:] or BUILDERS:
        started = time.monotonic()
        print(f"{built(name)} ready after {time.monotonic() - started:.0f} s", flush=True)
