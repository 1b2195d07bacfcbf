"""Pins (issue 14): a lineage held at one version by hand. The admin routes on real Postgres and
the fake vLLM; the trainer waiting on a pin with real TRL steps and episodes through the proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core import canary, pins, policy
from core.database import Sessions
from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy
from tests.core import test_lineages as lineages
from tests.core.test_canary import RULE
from tests.trainer.test_trainer_loop import make_trainer, play  # noqa: F401  (a fixture)

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}


def served(proxy: RunningProxy) -> str:
    return proxy.client().post("/v1/chat/completions", json=CHAT).headers["x-policy-version"]


def test_a_pinned_lineage_stays_until_unpinned(
    make_proxy: Any, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path
) -> None:
    proxy = make_proxy(admin_key="root")
    admin = proxy.client(Authorization="Bearer root")
    v1, v2 = (lineages.publish(sessions, fake_vllm, tmp_path, "policy") for _ in range(2))
    fake_vllm.loras.clear()  # pinning loads it first, as activate does

    r = admin.post(f"/admin/adapters/{v1}/pin", params={"note": "v2 answers in French"})
    assert r.status_code == 200, r.text
    assert r.json()["pinned"]["version"] == v1 and r.json()["pinned"]["note"].endswith("French")
    assert f"policy-v{v1}" in fake_vllm.loras and served(proxy) == str(v1)

    # Held: the trainer's publish, a canary, activate (by HTTP) are all refused.
    with pytest.raises(pins.Pinned, match="pinned at v"):
        lineages.publish(sessions, fake_vllm, tmp_path, "policy")
    with pytest.raises(pins.Pinned):
        lineages.publish(sessions, fake_vllm, tmp_path, "policy", canary_rule=RULE)
    refused = admin.post(f"/admin/adapters/{v2}/activate")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "lineage_pinned"
    assert "French" in refused.json()["error"]["message"] and served(proxy) == str(v1)
    [row] = admin.get("/admin/lineages").json()["data"]
    assert (row["lineage"], row["version"], row["pinned"]["version"]) == ("policy", v1, v1)

    # Another pin moves it (the base model too: version 0), and unpinning lets it go.
    assert admin.post(f"/admin/adapters/{v2}/pin").json()["pinned"]["version"] == v2
    assert served(proxy) == str(v2)
    assert admin.post("/admin/adapters/0/pin").status_code == 200 and served(proxy) == "0"
    unpinned = admin.post("/admin/lineages/policy/unpin").json()
    assert unpinned["pinned"] is None and unpinned["was"]["version"] == 0
    again = admin.post("/admin/lineages/policy/unpin")  # repeated: the same answer, nothing was
    assert again.status_code == 200 and again.json()["was"] is None
    assert admin.post(f"/admin/adapters/{v1}/activate").status_code == 200
    v3 = lineages.publish(sessions, fake_vllm, tmp_path, "policy")
    assert served(proxy) == str(v3)

    # Bad input: unknown version, bad lineage, a note with control characters.
    assert admin.post("/admin/adapters/999/pin").status_code == 404
    assert admin.post("/admin/lineages/no%20such/unpin").status_code == 400
    bad_note = admin.post(f"/admin/adapters/{v3}/pin", params={"note": "a\x00b"})
    assert bad_note.status_code == 400, bad_note.text
    assert admin.get("/admin/lineages").json()["data"][0]["pinned"] is None


def test_pinning_closes_the_open_canary_and_holds_only_its_own_lineage(
    sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    lineages.publish(sessions, fake_vllm, tmp_path, "writer")
    candidate = lineages.publish(sessions, fake_vllm, tmp_path, "writer", canary_rule=RULE)
    with sessions.begin() as session:
        policy.make_current(None, session=session, lineage="writer", pin=True, note="hold")
    with sessions.begin() as session:
        assert canary.opened(session=session) == {}
        [closed] = canary.history(session=session)
        assert (closed.candidate, closed.action) == (candidate, "superseded")
        assert policy.current(session=session, lineage="writer") is None
        assert set(pins.by_lineage(session=session)) == {"writer"}
    lineages.publish(sessions, fake_vllm, tmp_path, "rewriter")  # not held


@pytest.mark.slow
def test_the_trainer_waits_on_a_pin_and_goes_on_from_the_pinned_version(
    proxy: RunningProxy,
    make_trainer: Any,  # noqa: F811
    sessions: Sessions,
    monkeypatch: Any,
) -> None:
    trainer = make_trainer()
    play(proxy)
    assert trainer.step()
    with sessions.begin() as session:
        v1 = policy.current(session=session).version  # type: ignore[union-attr]
        policy.make_current(None, session=session, pin=True)  # held on the base model
    play(proxy, agent="b")
    assert not trainer.step() and trainer.metrics.pinned._value.get() == 1
    untrained = "SELECT count(*) FROM transition WHERE trained_at IS NULL AND claimed_by IS NULL"
    assert proxy.query(untrained) == [(8,)]  # nothing claimed while pinned

    # A pin that comes during a step: the batch goes back, no attempt counted, nothing published.
    with sessions.begin() as session:
        pins.unpin("policy", session=session)
    real_step = trainer.engine.step

    def step(samples: Any) -> Any:
        with sessions.begin() as session:
            policy.make_current(v1, session=session, pin=True)
        return real_step(samples)

    monkeypatch.setattr(trainer.engine, "step", step)
    assert not trainer.step()
    with sessions.begin() as session:
        assert [a.version for a in policy.versions(session=session)] == [v1]
        assert policy.current(session=session).version == v1  # type: ignore[union-attr]
    assert proxy.query(
        "SELECT claimed_by, train_attempts FROM transition WHERE trained_at IS NULL GROUP BY 1, 2"
    ) == [(None, 0)]

    # Unpinned: it trains again, from the pinned version.
    monkeypatch.setattr(trainer.engine, "step", real_step)
    with sessions.begin() as session:
        pins.unpin("policy", session=session)
    assert trainer.step() and trainer.metrics.pinned._value.get() == 0
    with sessions.begin() as session:
        new = policy.current(session=session)
    assert new is not None and new.version > v1 and new.stats["parent"] == v1  # type: ignore[index]
