"""The import contract (`lint-imports`, run by `make lint`) really fails when the layering breaks.

Each case copies the packages into a temporary directory, adds one forbidden import, and runs
lint-imports there with this project's configuration.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMPORTLINTER = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES = IMPORTLINTER["root_packages"]  # copied whole: every contract sees every package
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(
    tmp_path: Path, module: str = "", line: str = ""
) -> subprocess.CompletedProcess[str]:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.md"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    if module:
        path = tmp_path / module
        path.write_text((path.read_text() if path.exists() else "") + f"\n{line}\n")
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": str(LINT_IMPORTS.parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_packages_as_they_are_keep_every_contract(tmp_path: Path) -> None:
    result = lint_imports(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "9 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        (
            "proxy/relay/alias.py",
            "import trainer.data.store",
            "proxy.relay.alias -> trainer.data.store",
        ),
        ("trainer/loop.py", "from proxy.relay import wire", "trainer.loop -> proxy.relay.wire"),
        ("core/policy.py", "import proxy.relay.upstream", "core.policy -> proxy.relay.upstream"),
        ("proxy/relay/forward.py", "import demo.agent", "proxy.relay.forward -> demo.agent"),
        ("demo/stack.py", "import flywheel.cli", "demo.stack -> flywheel.cli"),
        # The applications' client stands on httpx alone (the demos may use it, nothing more
        # of flywheel/).
        ("demo/agent.py", "import flywheel.keys", "demo.agent -> flywheel.keys"),
        (
            "flywheel/client/records.py",
            "import sqlalchemy",
            "flywheel.client.records -> sqlalchemy",
        ),
        (
            "flywheel/client/sync.py",
            "from core import tenants",
            "flywheel.client.sync -> core.tenants",
        ),
        ("flywheel/client/base.py", "import proxy.errors", "flywheel.client.base -> proxy.errors"),
        ("core/record.py", "import torch", "core.record -> torch"),
        ("judge/worker.py", "import trainer.data.store", "judge.worker -> trainer.data.store"),
        ("core/ruler.py", "import torch", "core.ruler -> torch"),
        ("core/database.py", "import migrations", "core.database -> migrations"),
        ("core/record.py", "import fakes.vllm", "core.record -> fakes.vllm"),
        ("demo/stack.py", "from fakes import pg", "demo.stack -> fakes.pg"),
        ("fakes/pg.py", "import bench.common", "fakes.pg -> bench.common"),
        ("fakes/vllm.py", "import proxy.app", "fakes.vllm -> proxy.app"),
        (
            "tests/proxy/record/test_store.py",
            "import bench.storage",
            "tests.proxy.record.test_store -> bench.storage",
        ),
        # Inside the proxy: the record wing never reaches up into the relay, the relay never
        # into the routes, the floor into neither wing; the relay reaches record only through
        # its door (proxy/record/intake.py).
        (
            "proxy/record/recorder.py",
            "import proxy.relay.wire",
            "proxy.record.recorder -> proxy.relay.wire",
        ),
        (
            "proxy/relay/forward.py",
            "from proxy.routes import ops",
            "proxy.relay.forward -> proxy.routes.ops",
        ),
        (
            "proxy/metrics.py",
            "import proxy.record.journal",
            "proxy.metrics -> proxy.record.journal",
        ),
        (
            "proxy/relay/handoff.py",
            "from proxy.record import recorder",
            "proxy.relay.handoff -> proxy.record.recorder",
        ),
        # Inside the trainer: the data wing is torch-free and under the learner, the learner
        # under the loop, the settings under both wings.
        ("trainer/data/batch.py", "import torch", "trainer.data.batch -> torch"),
        (
            "trainer/data/store.py",
            "from trainer.learner import engine",
            "trainer.data.store -> trainer.learner.engine",
        ),
        (
            "trainer/learner/microbatch.py",
            "import trainer.loop",
            "trainer.learner.microbatch -> trainer.loop",
        ),
        (
            "trainer/config/data.py",
            "import trainer.data.store",
            "trainer.config.data -> trainer.data.store",
        ),
    ],
)
def test_a_forbidden_import_breaks_a_contract(
    tmp_path: Path, module: str, line: str, broken: str
) -> None:
    result = lint_imports(tmp_path, module, line)
    assert result.returncode == 1, result.stdout + result.stderr
    assert broken in result.stdout


@pytest.mark.parametrize("stray", ["proxy/stray.py", "trainer/stray.py"])
def test_a_module_outside_every_layer_breaks_the_contract(tmp_path: Path, stray: str) -> None:
    """A new module at proxy/'s or trainer/'s top must be given a layer (`exhaustive`): where it
    goes is a decision, docs/architecture.md's "where a new thing goes"."""
    result = lint_imports(tmp_path, stray, '"""Somewhere."""')
    assert result.returncode == 1, result.stdout + result.stderr
    assert stray.removesuffix(".py").replace("/", ".") in result.stdout
