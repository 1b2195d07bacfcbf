"""The adapter lifecycle of core/policy.py on real Postgres and fake vLLMs: publish, activate,
retire, and the one failure policy for "load into every replica, then move the alias"."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import psycopg
import pytest

from core import naming, policy, retirement, rollout
from core.database import Sessions
from core.vllm import AdapterRejected, VLLMAdmin
from fakes.vllm import FakeVLLM


def publish(
    sessions: Sessions, version: int, path: str = "/adapters/x", lineage: str = "policy"
) -> None:
    with sessions.begin() as session:
        parent = policy.current(session=session, lineage=lineage)
        policy.publish(
            session=session,
            lineage=lineage,
            parent=parent.version if parent else None,
            version=version,
            path=path,
            base_model="demo",
            stats={"loss": float("nan")},  # a diverged step still publishes (NaN -> null)
            trained_transitions=8,
        )


def current(sessions: Sessions, lineage: str = "policy") -> int | None:
    with sessions() as session:
        adapter = policy.current(session=session, lineage=lineage)
    return adapter.version if adapter else None


def test_publish_makes_the_new_version_current_and_notifies_on_commit(
    sessions: Sessions, database_url: str
) -> None:
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {policy.POLICY_CHANNEL}")
        publish(sessions, 1)
        publish(sessions, 2)
        heard = list(listener.notifies(timeout=2, stop_after=2))
    assert [n.channel for n in heard] == [policy.POLICY_CHANNEL] * 2
    assert current(sessions) == 2
    with sessions() as session:
        [first, second] = policy.versions(session=session)
    assert (first.is_current, second.is_current) == (False, True)
    assert second.stats == {"loss": None} and second.trained_transitions == 8


def test_retiring_keeps_the_newest_and_the_current_one(sessions: Sessions) -> None:
    for version in range(1, 6):
        publish(sessions, version)
    with sessions.begin() as session:
        policy.make_current(2, session=session)  # a rollback to an old version
        retirement.mark_retired(session=session, lineage="policy", keep=2)
    with sessions() as session:
        retired = {a.version for a in policy.versions(session=session) if a.retired_at}
    assert retired == {1, 3}  # 4 and 5 are the newest two, 2 is current
    with sessions.begin() as session, pytest.raises(policy.RetiredVersion, match="policy-v3"):
        policy.make_current(3, session=session)
    with sessions.begin() as session, pytest.raises(policy.UnknownVersion):
        policy.make_current(9, session=session)
    assert current(sessions) == 2
    with sessions.begin() as session:
        policy.make_current(None, session=session)  # the base model
    assert current(sessions) is None


def test_a_rollback_racing_a_retirement_never_points_at_a_retired_version(
    sessions: Sessions,
) -> None:
    """Retirement marks the row under the publish lock before anything is unloaded: a rollback
    that commits after it is refused; one that commits first keeps its version (current)."""
    for version in range(1, 4):
        publish(sessions, version)
    retiring = sessions()
    retiring.begin()
    retirement.mark_retired(session=retiring, lineage="policy", keep=1)  # v1, v2; holds the lock
    outcome: dict[str, object] = {}

    def roll_back() -> None:
        try:
            with sessions.begin() as session:
                policy.make_current(1, session=session)
        except policy.RetiredVersion as e:
            outcome["refused"] = str(e)

    thread = threading.Thread(target=roll_back)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive()  # waits for the retirement's lock
    retiring.commit()
    retiring.close()
    thread.join(10)
    assert "policy-v1 was retired" in str(outcome.get("refused"))
    assert current(sessions) == 3


def test_each_lineage_has_its_own_current_version_rollback_and_retirement(
    sessions: Sessions,
) -> None:
    """Issue 12: lineages share the version numbers (one sequence) and nothing else."""
    publish(sessions, 1, lineage="writer")
    publish(sessions, 2, lineage="rewriter")
    publish(sessions, 3, lineage="writer")
    publish(sessions, 4, lineage="writer")
    assert (current(sessions, "writer"), current(sessions, "rewriter")) == (4, 2)
    assert current(sessions) is None  # the default lineage was never trained: the base model
    with sessions() as session:
        assert {k: a.name for k, a in policy.currents(session=session).items()} == {
            "writer": "writer-v4",
            "rewriter": "rewriter-v2",
        }
        assert [a.version for a in policy.versions(session=session, lineage="writer")] == [1, 3, 4]
    # A compare-and-set on the writer's lineage ignores the rewriter's publishes, and the reverse.
    with sessions.begin() as session, pytest.raises(policy.PolicyMoved, match="writer moved"):
        policy.publish(
            session=session,
            lineage="writer",
            parent=3,
            version=5,
            path="/x",
            base_model="demo",
            stats={},
            trained_transitions=1,
        )
    with sessions.begin() as session:
        policy.make_current(1, session=session)  # the writer rolls back; the rewriter stays
        policy.make_current(None, session=session, lineage="rewriter")  # the base model
        retirement.mark_retired(session=session, lineage="writer", keep=1)
    assert (current(sessions, "writer"), current(sessions, "rewriter")) == (1, None)
    with sessions() as session:
        retired = {a.name for a in policy.versions(session=session) if a.retired_at}
    assert retired == {"writer-v3"}  # v4 is the writer's newest, v1 its current; v2 not its own


def test_lineage_names_are_checked() -> None:
    assert naming.check_lineage("writer_2.a-b") == "writer_2.a-b"
    for bad in ("", "-x", "a/b", "a@1", "a b", "x" * 64):
        with pytest.raises(ValueError, match="not a lineage name"):
            naming.check_lineage(bad)


def test_load_everywhere_undoes_only_its_own_loads(tmp_path: Path) -> None:
    path = tmp_path / "policy-v7"
    path.mkdir()
    (path / "adapter_config.json").write_text('{"r": 16}')

    async def go(urls: list[str]) -> rollout.Rollout:
        vllm = VLLMAdmin(api_key=None)
        try:
            return await rollout.load_everywhere(vllm, urls, "policy-v7", str(path))
        finally:
            await vllm.close()

    with FakeVLLM() as serving, FakeVLLM() as fresh, FakeVLLM() as small:
        serving.state.max_lora_rank = fresh.state.max_lora_rank = 16
        serving.loras["policy-v7"] = str(path)  # it serves this version already
        small.state.max_lora_rank = 8  # refuses a rank-16 adapter
        with pytest.raises(AdapterRejected, match="greater than max_lora_rank"):
            asyncio.run(go([serving.url, fresh.url, small.url]))
        assert "policy-v7" in serving.loras  # not unloaded: it was there before this call
        assert "policy-v7" not in fresh.loras and "policy-v7" not in small.loras
        went = asyncio.run(go([serving.url, fresh.url]))
    assert went.loaded == [fresh.url, serving.url] and went.unreachable == []


def test_load_everywhere_replaces_a_stale_adapter_of_the_same_name(tmp_path: Path) -> None:
    """A vLLM that outlived its database (reset, restored) may hold `policy-v1` from another
    directory: served as ours, its weights would be another policy's. It is replaced."""
    ours, stale = tmp_path / "policy-v1", tmp_path / "old" / "policy-v1"
    for path in (ours, stale):
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text('{"r": 8}')

    async def go(url: str) -> rollout.Rollout:
        vllm = VLLMAdmin(api_key=None)
        try:
            return await rollout.load_everywhere(vllm, [url], "policy-v1", str(ours))
        finally:
            await vllm.close()

    with FakeVLLM() as fake:
        fake.loras["policy-v1"] = str(stale)
        asyncio.run(go(fake.url))
        assert fake.loras["policy-v1"] == str(ours)
        loads = [r["path"] for r in fake.requests if "lora_adapter" in r["path"]]
        assert loads == ["/v1/unload_lora_adapter", "/v1/load_lora_adapter"]
        asyncio.run(go(fake.url))  # ours now: nothing to do
        assert [r["path"] for r in fake.requests if "lora_adapter" in r["path"]] == loads


def test_no_adapter_name_is_ever_given_twice(sessions: Sessions) -> None:
    """vLLM keys prefix-cache blocks by adapter name and path, and serves a name it holds from
    what it loaded (vLLM issue 42125: stale blocks for a reused name), so a name must never
    come back with other weights. A number taken by a publish that then failed (its adapter may
    be in vLLM already) or a retired version's is not given again, in any lineage."""

    def take() -> int:
        with sessions.begin() as session:
            return policy.next_version(session=session)

    with pytest.raises(policy.PolicyMoved), sessions.begin() as session:
        lost = policy.next_version(session=session)  # saved and loaded, then the publish failed
        raise policy.PolicyMoved(None, 1, "acme.policy")
    first = take()
    publish(sessions, first, lineage="acme.policy")
    with sessions.begin() as session:
        policy.make_current(None, session=session, lineage="acme.policy")
        retirement.mark_retired(session=session, lineage="acme.policy", keep=0)
    with sessions() as session:
        assert policy.get(first, session=session).retired_at is not None  # type: ignore[union-attr]
    later = [take() for _ in range(3)]
    assert len({lost, first, *later}) == 5 and min(later) > max(lost, first)
    publish(sessions, later[0], lineage="acme.writer")
    with sessions() as session:
        names = [a.name for a in policy.versions(session=session)]
    assert names == [f"acme.policy-v{first}", f"acme.writer-v{later[0]}"]
