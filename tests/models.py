"""The warm-started models the e2e tests train, by name, under TEST_HOME/models.

Each takes minutes of one core to build (demo/calculator.py, demo/calc_tools.py,
demo/sql_model.py), so a test that needs one is marked `@pytest.mark.models(name)`: conftest runs
such tests last and builds their models in a background process from the session's start, on the
core the other tests leave idle. The builders hold a lock on their directory, so a test that
needs its model before the background build is done waits for it rather than building it again.

    python -m tests.models calculator sql calc-tools     # what conftest starts (niced)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from demo.stack import TASKS
from demo.tiny_model import one_build_at_a_time
from tests.conftest import TEST_HOME


@one_build_at_a_time
def build_judge_venv(target: Path) -> Path:
    """A venv for `flywheel judge`: litellm at the `judge` extra's pin, with the openai<3 it
    needs, in its own site-packages, over this venv's (a .pth adds those after its own): the
    judge runs there as in its image, while the tests' clients keep today's openai 3."""
    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        (pin,) = tomllib.load(f)["project"]["optional-dependencies"]["judge"]
    stamp = target / f".built-{pin}"
    if stamp.exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
    (site,) = (target / "lib").glob("python3*/site-packages")
    here = sysconfig.get_paths()["purelib"]
    (site / "zz_flywheel.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    pip = [str(target / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    # pip sees the project's packages through the .pth and installs only what differs (openai
    # 2, litellm); it then says openai-agents wants openai 3: true, and not this venv's concern.
    subprocess.run([*pip, "install", pin], check=True, capture_output=True)
    subprocess.run(
        [str(target / "bin" / "python"), "-c", "import litellm, judge.worker"],
        check=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    stamp.touch()
    return target


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "calculator": TASKS["calc"].build_model,
    "calc-tools": TASKS["calc-tools"].build_model,
    "sql": TASKS["sql"].build_model,
    "judge-venv": build_judge_venv,
}


def path(name: str) -> Path:
    return TEST_HOME / "models" / name


def built(name: str) -> Path:
    """The model's directory, built (or waited for) first."""
    return BUILDERS[name](path(name))


if __name__ == "__main__":
    for name in sys.argv[1:]:
        started = time.monotonic()
        print(f"{built(name)} ready after {time.monotonic() - started:.0f} s", flush=True)
