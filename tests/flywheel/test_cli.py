"""The `flywheel` console script as users run it: a real process, real signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from pydantic_settings import BaseSettings

from demo.vllm_server import free_port
from fakes.vllm import FakeVLLM
from flywheel.cli import main, parser
from flywheel.options import build, env_name
from judge.config import JudgeSettings
from proxy.config import ProxySettings
from trainer.config import TrainerSettings

FLYWHEEL = [sys.executable, "-m", "flywheel"]


@pytest.mark.slow
def test_flywheel_proxy_serves_records_and_flushes_on_sigterm(
    database_url: str, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    port = free_port()
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": database_url, "FLYWHEEL_HOME": str(tmp_path)}
    process = subprocess.Popen(
        [*FLYWHEEL, "proxy", "--upstream", fake_vllm.url, "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        ids = []
        for _ in range(20):
            r = httpx.post(
                url + "/v1/chat/completions",
                headers={"X-Episode-Id": "cli"},
                json={"model": "demo", "messages": [{"role": "user", "content": "x"}]},
            )
            ids.append(r.headers["x-transition-id"])
    finally:
        process.send_signal(signal.SIGTERM)  # graceful: the writer flushes before exit
        output = process.communicate(timeout=60)[0].decode()
    # uvicorn re-raises the signal once its shutdown is complete: -SIGTERM is a clean exit.
    assert process.returncode in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output

    with psycopg.connect(database_url) as conn:
        stored = conn.execute("SELECT id::text FROM transition").fetchall()
    assert sorted(r[0] for r in stored) == sorted(ids)


@pytest.mark.slow
def test_bad_settings_fail_at_start_naming_the_fix(tmp_path: Path) -> None:
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path)}
    bad = subprocess.run(
        [*FLYWHEEL, "proxy", "--upstream", "ftp://x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "must start with http:// or https://" in bad.stderr
    missing = subprocess.run(
        [*FLYWHEEL, "proxy"], env=env, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode != 0 and "--upstream" in missing.stderr
    required = subprocess.run(
        [*FLYWHEEL, "migrate"],
        env={**env, "FLYWHEEL_REQUIRE_DATABASE_URL": "true"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert required.returncode != 0 and "FLYWHEEL_DATABASE_URL" in required.stderr


@pytest.mark.parametrize(
    ("command", "kind"),
    [("proxy", ProxySettings), ("trainer", TrainerSettings), ("judge", JudgeSettings)],
)
def test_help_names_every_setting_with_its_variable_default_and_help(
    command: str, kind: type[BaseSettings], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    unwrapped = "".join(shown.split())  # also within words, at hyphens
    for name, field in kind.model_fields.items():
        assert field.description, f"{kind.__name__}.{name} has no help text"
        flag, variable = "--" + name.replace("_", "-"), env_name(kind, name)
        assert re.search(rf"{flag}(?![\w-])", shown), name
        assert f"[{variable}; default: " in shown, name
        assert "".join(field.description.split()) in unwrapped, name


def test_flags_win_over_variables_and_variables_over_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLYWHEEL_PORT", "9000")
    monkeypatch.setenv("FLYWHEEL_KEEP_ALIVE_S", "30")
    for unset in ("FLYWHEEL_UPSTREAM", "FLYWHEEL_DURABLE", "FLYWHEEL_WRITER_BATCH_SIZE"):
        monkeypatch.delenv(unset, raising=False)
    args = parser().parse_args(
        [
            "proxy",
            "--upstream",
            "http://a:1/v1",
            "--upstream",
            "http://b:2,http://c:3",  # a flag takes what its variable takes
            "--port",
            "8100",
            "--durable",
            "--adapter-per-agent",
            "sql=writer+rewriter",
        ]
    )
    settings = build(ProxySettings, args)
    assert settings.upstream == ["http://a:1", "http://b:2", "http://c:3"]
    assert settings.port == 8100 and settings.keep_alive_s == 30
    assert settings.durable is True and settings.writer_batch_size == 500
    assert settings.adapter_per_agent == {"writer": "sql", "rewriter": "sql"}


def test_the_cli_imports_no_package_an_image_lacks() -> None:
    """Every image runs `flywheel`: importing it loads each process's settings, never the demo
    (httpx), torch, numpy (the trainer's; the proxy image has none: the first container built
    from it could not start, trainer/config.py imported trainer/ope.py) or litellm; each command
    imports what it runs when it runs."""
    code = "import sys, flywheel.cli; print(' '.join({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    heavy = {"demo", "bench", "httpx", "torch", "numpy", "transformers", "trl", "litellm", "vllm"}
    assert heavy.isdisjoint(loaded), heavy.intersection(loaded)


@pytest.mark.slow
def test_a_skip_fails_the_run_under_ci_and_is_named_either_way(tmp_path: Path) -> None:
    """tests/no_silent_skips.py: a test skipped for what the environment lacks hid on CI."""
    (tmp_path / "test_one.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    pass\n\n"
        "def test_needs_root():\n    pytest.skip('iptables needs root')\n"
    )

    def run(ci: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "tests.no_silent_skips", "-ra", "-q",
             "-p", "no:cacheprovider", str(tmp_path / "test_one.py")],
            env={**os.environ, "CI": ci, "PYTHONPATH": str(Path.cwd())},
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip

    here = run("")
    assert here.returncode == 0 and "SKIPPED" in here.stdout
    assert "iptables needs root" in here.stdout
    ci = run("true")
    assert ci.returncode == 1, ci.stdout
    assert "1 skipped under CI, where none may be" in ci.stdout
    assert "test_one.py::test_needs_root: Skipped: iptables needs root" in ci.stdout
