"""The processes under test, each its own, started as a person would start them: the fake vLLM
(`python -m fakes.vllm`), `flywheel proxy`, `flywheel trainer`; and the litellm install that
`flywheel judge` and a proxy with provider routes run in. Each is ready when its health endpoint
answers; its output goes to a log under .flywheel/bench/.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from demo.tiny_model import one_build_at_a_time
from demo.vllm_server import free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".flywheel" / "bench"  # git-ignored: the processes' logs, the benchmarks' files
START_TIMEOUT_S = 120.0  # LiteLLM's proxy imports for ~10 s on two busy cores


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child: this checkout first on PYTHONPATH, so its code is what runs."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def log_file(name: str) -> Path:
    """Where a process called `name` writes its output (the last one's: each start truncates)."""
    WORK.mkdir(parents=True, exist_ok=True)
    return WORK / f"{name}.log"


@dataclass
class Server:
    """A started process and the URL it serves; `stop()` terminates it (kills it after 30 s)."""

    name: str
    process: subprocess.Popen[bytes]
    url: str  # base URL, without /v1
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    name: str, argv: list[str], health: str, env: dict[str, str], port: int | None = None
) -> Server:
    """`argv --port PORT` (a free one by default), ready once `health` answers."""
    port = port or free_port()
    log_path = log_file(name)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    server = Server(name, process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_http(server.url + health, process, timeout=START_TIMEOUT_S, log_path=log_path)
    except BaseException:
        server.stop()
        raise
    return server


def start_fake(
    latency_s: float,
    token_delay_s: float = 0.0,
    *,
    always_detail: bool = True,
    load_delay_s: float = 0.0,
    port: int | None = None,
    judge_answers: bool = False,
    max_running: int = 0,
) -> Server:
    """The fake vLLM. `always_detail`: every answer carries token ids and logprobs (the issue's
    "fixed-size completions with token ids/logprobs"), so a direct call costs the fake what a
    proxied one does and the comparison isolates the proxy; False: only when asked, as vLLM."""
    argv = [sys.executable, "-m", "fakes.vllm", "--latency-s", str(latency_s)]
    argv += ["--token-delay-s", str(token_delay_s), "--load-delay-s", str(load_delay_s)]
    argv += ["--max-running", str(max_running)]
    if always_detail:
        argv.append("--always-detail")
    if judge_answers:
        argv.append("--judge-answers")
    return start_server("fake_vllm", argv, "/health", child_env(), port)


def start_flywheel(
    upstream: str | Sequence[str],
    database_url: str,
    *,
    home: Path | None = None,
    settings: dict[str, str] | None = None,
    port: int | None = None,
    python: str = sys.executable,
) -> Server:
    """`flywheel proxy`; `settings` are FLYWHEEL_* variables (e.g. FLYWHEEL_DURABLE="true");
    `python`: another install's interpreter (the litellm venv, for FLYWHEEL_ROUTES)."""
    env = child_env(
        FLYWHEEL_DATABASE_URL=database_url,
        FLYWHEEL_HOME=str(home or tempfile.mkdtemp(prefix="flywheel-bench-")),
        FLYWHEEL_LOG_LEVEL="warning",
        **(settings or {}),
    )
    argv = [python, "-m", "flywheel", "proxy"]
    for url in [upstream] if isinstance(upstream, str) else upstream:  # several: replicas
        argv += ["--upstream", url]
    return start_server("flywheel_proxy", argv, "/healthz", env, port)


def start_trainer(
    model: Path,
    upstream: Sequence[str],
    database_url: str,
    *,
    home: Path,
    settings: dict[str, str] | None = None,
    log_name: str = "flywheel_trainer",
) -> Server:
    """`flywheel trainer`, ready once its metrics port answers (it opens after the engine is
    built); `settings` are FLYWHEEL_* variables. Its `url` is the metrics endpoint's base."""
    port = free_port()
    env = child_env(
        FLYWHEEL_DATABASE_URL=database_url,
        FLYWHEEL_HOME=str(home),
        FLYWHEEL_METRICS_PORT=str(port),
        **(settings or {}),
    )
    argv = [sys.executable, "-m", "flywheel", "trainer", "--model", str(model)]
    argv += ["--adapters-dir", str(home / "adapters")]
    for url in upstream:
        argv += ["--vllm", url]
    log_path = log_file(log_name)
    with log_path.open("ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(log_name, process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_http(server.url + "/metrics", process, timeout=START_TIMEOUT_S, log_path=log_path)
    except BaseException:
        server.stop()
        raise
    return server


LITELLM_LOCK = ROOT / "constraints-litellm.txt"
FRAMEWORKS_LOCK = ROOT / "constraints-frameworks.txt"


def extra_pins(extra: str) -> list[str]:
    """pyproject.toml's pins of one optional extra."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["optional-dependencies"][extra])


def overlay_venv(target: Path, over: str, pins: list[str], locks: list[Path], check: str) -> Path:
    """A venv at `target` whose .pth adds the site-packages `over` after its own, with `pins`
    installed into its own (pip sees what `over` has and installs only what differs), at the
    versions of `locks[0]` where given; `check` (Python) must then run. A stamp names the pins
    and the locks' digest: built once, rebuilt when either changes."""
    digest = hashlib.sha1(b"".join(lock.read_bytes() for lock in locks)).hexdigest()[:12]
    stamp = target / f".built-{hashlib.sha1(repr(pins).encode()).hexdigest()[:8]}-{digest}"
    if stamp.exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
    (site,) = (target / "lib").glob("python3*/site-packages")
    (site / "zz_flywheel.pth").write_text(f"import site; site.addsitedir({over!r})\n")
    python = str(target / "bin" / "python")
    lock = ["-c", str(locks[0])] if locks else []
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q", "install", *lock, *pins]
    subprocess.run(pip, check=True, capture_output=True)
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    subprocess.run([python, "-c", check], check=True, env=env)
    stamp.touch()
    return target


def site_packages(venv: Path) -> str:
    (site,) = (venv / "lib").glob("python3*/site-packages")
    return str(site.resolve())


@one_build_at_a_time
def build_litellm_venv(target: Path, *, locked: bool = True) -> Path:
    """A venv for `flywheel judge` and for a proxy with routes: litellm at the `litellm` extra's
    pin, with the openai<3 it needs, in its own site-packages, over this venv's (a .pth adds
    those after its own): they run there as in their images, while the tests' clients keep
    today's openai 3. Its packages at the versions of constraints-litellm.txt (`make lock`
    refreshes it); pip then says openai-agents wants openai 3: true, and not this venv's concern."""
    here = sysconfig.get_paths()["purelib"]
    check = "import litellm, judge.worker, proxy.relay.providers"
    locks = [LITELLM_LOCK] if locked else []
    return overlay_venv(target, here, extra_pins("litellm"), locks, check)


@one_build_at_a_time
def build_frameworks_venv(
    target: Path, *, litellm: Path | None = None, locked: bool = True
) -> Path:
    """The agent frameworks that reach a model through litellm or need openai<3 (DSPy, CrewAI,
    LlamaIndex: the `frameworks` extra), for tests/frameworks/test_frameworks.py to run its clients
    in: a
    venv over the litellm venv (`litellm`, by default `target`'s sibling litellm-venv, built
    first), so they get its litellm and openai 2, and this venv's packages below those. Their
    own packages (an older pydantic for CrewAI, ...) at constraints-frameworks.txt's versions."""
    litellm = build_litellm_venv(litellm or target.with_name("litellm-venv"), locked=locked)
    check = "import dspy, crewai, llama_index.llms.openai_like"
    locks = [FRAMEWORKS_LOCK, LITELLM_LOCK] if locked else []
    return overlay_venv(target, site_packages(litellm), extra_pins("frameworks"), locks, check)
