"""Rollback: the admin endpoint and `flywheel adapters`, on real Postgres and the fake vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy


def add_versions(proxy: RunningProxy, tmp_path: Path, count: int) -> None:
    with psycopg.connect(proxy.database_url, autocommit=True) as conn:
        for v in range(1, count + 1):
            path = tmp_path / f"policy-v{v}"
            path.mkdir()
            conn.execute(
                "INSERT INTO adapter_version (version, name, path, base_model, is_current) "
                "VALUES (%s, %s, %s, 'demo', %s)",
                (v, f"policy-v{v}", str(path), v == count),
            )


def test_admin_is_off_without_a_key_and_guarded_with_one(make_proxy: Any) -> None:
    off = make_proxy()
    assert off.client().post("/admin/adapters/1/activate").status_code == 403
    on = make_proxy(admin_key="root")
    assert on.client().get("/admin/adapters").status_code == 401
    assert on.client(Authorization="Bearer nope").get("/admin/adapters").status_code == 401
    assert on.client(Authorization="Bearer root").get("/admin/adapters").status_code == 200


def test_what_cannot_name_a_version_or_a_lineage_is_a_400_not_a_server_error(
    make_proxy: Any,
) -> None:
    """Found by the Schemathesis run (tests/proxy/test_openapi.py): a version beyond int4 and a
    lineage
    with a NUL reached Postgres, and the database's refusal was a 500."""
    admin = make_proxy(admin_key="root").client(Authorization="Bearer root")
    for method, url in [
        ("POST", "/admin/adapters/2147483648/activate"),
        ("POST", "/admin/adapters/99999999999999/pin"),
        ("POST", "/admin/adapters/-1/activate"),
        ("GET", "/admin/adapters?lineage=a%00b"),
        ("GET", "/admin/canaries?lineage=a%00b"),
    ]:
        r = admin.request(method, url)
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["param"] in ("path.version", "query.lineage")
    assert admin.post("/admin/adapters/2147483647/activate").status_code == 404  # the last one


def test_activate_loads_into_vllm_then_moves_the_alias(
    make_proxy: Any, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    proxy = make_proxy(admin_key="root")
    add_versions(proxy, tmp_path, 3)
    admin = proxy.client(Authorization="Bearer root")
    r = admin.post("/admin/adapters/1/activate")
    assert r.status_code == 200, r.text
    assert fake_vllm.loras["policy-v1"] == str(tmp_path / "policy-v1")  # loaded first
    chat = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
    assert proxy.client().post("/v1/chat/completions", json=chat).headers["x-policy-version"] == "1"
    listed = admin.get("/admin/adapters").json()["data"]
    assert [a["version"] for a in listed if a["is_current"]] == [1]
    # Version 0 is the base model.
    assert admin.post("/admin/adapters/0/activate").status_code == 200
    assert proxy.client().post("/v1/chat/completions", json=chat).headers["x-policy-version"] == "0"
    assert admin.post("/admin/adapters/9/activate").status_code == 404


def test_a_refused_or_retired_adapter_does_not_move_the_alias(
    make_proxy: Any, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    proxy = make_proxy(admin_key="root")
    add_versions(proxy, tmp_path, 2)
    admin = proxy.client(Authorization="Bearer root")
    (tmp_path / "policy-v1" / "adapter_config.json").write_text('{"r": 64}')
    refused = admin.post("/admin/adapters/1/activate")
    assert refused.status_code == 502 and refused.json()["error"]["code"] == "adapter_rejected"
    (tmp_path / "policy-v1").joinpath("adapter_config.json").unlink()
    (tmp_path / "policy-v1").rmdir()  # its directory gone: vLLM answers 404, the alias stays
    missing = admin.post("/admin/adapters/1/activate")
    assert missing.status_code == 502 and missing.json()["error"]["code"] == "adapter_rejected"
    # Retired (as the trainer does it: marked, then unloaded and deleted): refused at once.
    proxy.query("UPDATE adapter_version SET retired_at = now() WHERE version = 1 RETURNING 1")
    retired = admin.post("/admin/adapters/1/activate")
    assert retired.status_code == 409 and retired.json()["error"]["code"] == "adapter_retired"
    assert proxy.query("SELECT version FROM adapter_version WHERE is_current") == [(2,)]
    assert "policy-v1" not in fake_vllm.loras  # nothing was left loaded by the refusals


def test_a_proxy_that_cannot_see_the_adapters_can_still_roll_back(
    make_proxy: Any, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    """Deployments mount the adapters volume on the trainer and vLLM, not on the proxy: whether a
    version can be activated is Postgres's knowledge (retired or not), not the proxy's disk."""
    proxy = make_proxy(admin_key="root")
    fake_vllm.state.check_lora_paths = False  # vLLM sees a volume the proxy does not
    with psycopg.connect(proxy.database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO adapter_version (version, name, path, base_model) "
            "VALUES (1, 'policy-v1', '/adapters/policy-v1', 'demo')"
        )
    r = proxy.client(Authorization="Bearer root").post("/admin/adapters/1/activate")
    assert r.status_code == 200, r.text
    assert fake_vllm.loras["policy-v1"] == "/adapters/policy-v1"


@pytest.mark.slow
def test_flywheel_adapters_cli(database_url: str, fake_vllm: FakeVLLM, tmp_path: Path) -> None:
    path = tmp_path / "policy-v1"
    path.mkdir()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO adapter_version (version, name, path, base_model) "
            "VALUES (1, 'policy-v1', %s, 'demo')",
            (str(path),),
        )
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": database_url}
    cli = [sys.executable, "-m", "flywheel", "adapters"]
    activated = subprocess.run(
        [*cli, "activate", "1", "--vllm", fake_vllm.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert activated.returncode == 0, activated.stderr
    assert "policy-v1" in fake_vllm.loras
    listed = subprocess.run([*cli, "list"], env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "* v1" in listed.stdout
    assert "lineage policy: 1 versions, serving policy-v1" in listed.stdout, listed.stdout
    missing = subprocess.run(
        [*cli, "activate", "7", "--vllm", fake_vllm.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode != 0 and "no adapter version 7" in missing.stderr
    bad_url = subprocess.run(
        [*cli, "activate", "1", "--vllm", "vllm:8000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad_url.returncode != 0 and "must start with http:// or https://" in bad_url.stderr

    # Pin, then the list says so and activate is refused until unpin.
    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *argv], env=env, capture_output=True, text=True, timeout=60)

    pinned = run("pin", "1", "--vllm", fake_vllm.url, "--note", "known good")
    assert pinned.returncode == 0 and "now serves policy-v1, pinned" in pinned.stdout
    assert "pinned since" in run("list").stdout and "(known good)" in run("list").stdout
    held = run("activate", "0", "--vllm", fake_vllm.url)
    assert held.returncode != 0 and "lineage policy is pinned at v1" in held.stderr
    assert run("unpin").stdout.strip() == "lineage policy unpinned"
    assert run("unpin").stdout.strip() == "lineage policy was not pinned"
    assert run("activate", "0", "--vllm", fake_vllm.url).returncode == 0


def test_a_restarted_vllm_gets_the_adapter_back_on_first_use(
    make_proxy: Any, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    proxy = make_proxy()
    add_versions(proxy, tmp_path, 1)  # v1 current, its directory on disk
    fake_vllm.loras["policy-v1"] = str(tmp_path / "policy-v1")
    chat = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
    with proxy.client() as c:
        while c.post("/v1/chat/completions", json=chat).headers["x-policy-version"] != "1":
            pass  # the alias picks v1 up within its refresh interval
        fake_vllm.loras.clear()  # vLLM restarted
        r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert r.headers["x-policy-version"] == "1"
    assert fake_vllm.loras == {"policy-v1": str(tmp_path / "policy-v1")}


def test_every_proxy_follows_a_publish_at_once_not_at_its_next_poll(
    make_proxy: Any, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    follower = make_proxy(alias_refresh_s=3600)  # it would poll once an hour
    admin = make_proxy(admin_key="root")
    add_versions(admin, tmp_path, 2)  # inserted behind everyone's back: no NOTIFY
    chat = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
    assert (
        follower.client().post("/v1/chat/completions", json=chat).headers["x-policy-version"] == "0"
    )
    activated = admin.client(Authorization="Bearer root").post("/admin/adapters/1/activate")
    assert activated.status_code == 200
    deadline = time.monotonic() + 5
    with follower.client() as c:
        while (
            version := c.post("/v1/chat/completions", json=chat).headers["x-policy-version"]
        ) != "1":
            assert time.monotonic() < deadline, f"the follower still serves v{version}"
            time.sleep(0.01)


def test_the_admin_routes_answer_503_while_postgres_is_down(
    own_postgres: Any, make_proxy: Any
) -> None:
    """Found by the Schemathesis run through an outage (tests/proxy/test_openapi.py): they were
    500s."""
    proxy = make_proxy(database_url=own_postgres.url, admin_key="root")
    own_postgres.stop()
    admin = proxy.client(Authorization="Bearer root")
    for method, url in [
        ("GET", "/admin/adapters"),
        ("GET", "/admin/canaries"),
        ("GET", "/admin/lineages"),
        ("POST", "/admin/adapters/1/activate"),
        ("POST", "/admin/adapters/1/pin"),
        ("POST", "/admin/lineages/policy/unpin"),
    ]:
        r = admin.request(method, url)
        assert r.status_code == 503, (url, r.text)
        assert r.json()["error"]["message"] == "database unavailable"


def _lora_dir(path: Path, rank: int = 8) -> Path:
    path.mkdir()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    (path / "optimizer.pt").write_bytes(b"another run's Adam")
    return path


@pytest.mark.slow
def test_flywheel_adapters_import(database_url: str, fake_vllm: FakeVLLM, tmp_path: Path) -> None:
    """An adapter trained elsewhere becomes the lineage's next version: copied into the adapters
    directory under its version's name, loaded into vLLM, then current. Refused without a trace:
    a directory that is not a LoRA adapter, one vLLM rejects, a pinned lineage."""
    adapters = tmp_path / "adapters"
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": database_url}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "flywheel", "adapters", "import", "--vllm", fake_vllm.url,
             "--adapters-dir", str(adapters), "--lineage", "writer", *argv],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def rows() -> list[tuple[Any, ...]]:
        with psycopg.connect(database_url, autocommit=True) as conn:
            return conn.execute(
                "SELECT version, name, path, is_current, trained_transitions, stats "
                "FROM adapter_version WHERE lineage = 'writer' ORDER BY version"
            ).fetchall()

    empty = tmp_path / "empty"
    empty.mkdir()
    for bad, says in [
        (empty, "needs adapter_config.json, adapter_model.safetensors"),
        (tmp_path / "nowhere", "is not a PEFT LoRA adapter directory"),
    ]:
        refused = run("--adapter", str(bad))
        assert refused.returncode != 0 and says in refused.stderr, refused.stderr
    not_lora = _lora_dir(tmp_path / "ia3")
    (not_lora / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    assert "is not a LoRA adapter" in run("--adapter", str(not_lora)).stderr
    too_big = run("--adapter", str(_lora_dir(tmp_path / "r64", rank=64)))
    assert too_big.returncode != 0 and "max_lora_rank" in too_big.stderr, too_big.stderr
    assert rows() == [] and not [p for p in adapters.iterdir()]  # nothing left behind

    source = _lora_dir(tmp_path / "warm-start")
    done = run("--adapter", str(source))
    assert done.returncode == 0, done.stderr
    [(version, name, path, current, trained, stats)] = rows()
    assert name == f"writer-v{version}" and current and trained == 0
    assert stats == {"imported_from": str(source)}
    assert f"lineage writer now serves writer-v{version}" in done.stdout
    assert Path(path) == (adapters / name).resolve() and fake_vllm.loras[name] == path
    assert sorted(p.name for p in Path(path).iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]  # the weights only: the trainer's optimizer starts fresh on them
    again = run("--adapter", str(source))  # a second import is a new version, the first kept
    assert again.returncode == 0 and [r[3] for r in rows()] == [False, True]

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO lineage_pin (lineage, version) VALUES ('writer', %s)", (version,))
    pinned = run("--adapter", str(source))
    assert pinned.returncode != 0 and "lineage writer is pinned" in pinned.stderr
    assert len(rows()) == 2 and len(list(adapters.iterdir())) == 2
