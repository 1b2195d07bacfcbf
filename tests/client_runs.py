"""Framework clients that cannot run in this venv, each a script of tests/clients/ run as a child
with a JSON config as its argument, printing what its framework handed back as JSON: DSPy, CrewAI
and LlamaIndex in the frameworks venv (fakes/processes.py build_frameworks_venv: litellm and
openai 2 under them), the `openai` npm package in Node (installed once, from
tests/clients/package-lock.json, into .flywheel/test/node/)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from demo.tiny_model import one_build_at_a_time
from tests import models
from tests.conftest import TEST_HOME

CLIENTS = Path(__file__).resolve().parent / "clients"
NODE_PACKAGE = ("package.json", "package-lock.json")


def run(argv: list[str], config: dict[str, Any], cwd: Path | None = None) -> dict[str, Any]:
    """`argv CONFIG-JSON`; its last line of output, parsed. A failure shows the child's stderr."""
    done = subprocess.run(
        [*argv, json.dumps(config)], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert done.returncode == 0, f"{argv[-1]} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def python_client(script: str, config: dict[str, Any]) -> dict[str, Any]:
    """tests/clients/`script` in the frameworks venv (built in the background: tests that call
    this are marked `models("frameworks-venv")`)."""
    python = models.built("frameworks-venv") / "bin" / "python"
    return run([str(python), str(CLIENTS / script)], config)


@one_build_at_a_time
def install_node_client(target: Path) -> Path:
    """tests/clients/package-lock.json's packages installed (`npm ci`) into `target`, once per
    lock: npm's registry is asked only when the lock changes."""
    digest = hashlib.sha1(b"".join((CLIENTS / f).read_bytes() for f in NODE_PACKAGE)).hexdigest()
    stamp = target / f".installed-{digest[:12]}"
    if stamp.exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in NODE_PACKAGE:
        shutil.copy(CLIENTS / name, target / name)
    npm = ["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"]
    subprocess.run(npm, cwd=target, check=True, capture_output=True, timeout=300)
    stamp.touch()
    return target


def node_client(config: dict[str, Any]) -> dict[str, Any]:
    """tests/clients/openai_node.mjs, run by `node` next to its installed packages (Node resolves
    an ES module's imports from the script's own folder)."""
    home = install_node_client(TEST_HOME / "node" / "openai")
    shutil.copy(CLIENTS / "openai_node.mjs", home / "openai_node.mjs")
    return run(["node", "openai_node.mjs"], config, cwd=home)
