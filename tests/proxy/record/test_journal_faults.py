"""The journal failing, and a damaged journal: nothing acknowledged is dropped, the writer lives on,
/healthz says so, and the proxy starts on a journal with a corrupt line (issue 13, items 1-2).

The OS failure itself is injected (an `OSError(ENOSPC)` from `Journal.append`, as a full disk
raises it); everything around it is real: Postgres (or a closed port where it is down), the
recorder's tasks, the files, the running proxy.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import text

from core import database
from core.database import AsyncSessions
from core.record import TransitionRecord
from fakes.traffic import episode_records
from fakes.vllm import FakeVLLM
from proxy.record.journal import Journal
from proxy.record.queue import record_bytes
from proxy.record.recorder import Recorder
from tests.conftest import RunningProxy

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def records(n: int, seed: int = 1) -> list[TransitionRecord]:
    return episode_records(random.Random(seed), turns=n)


def disk_full(*_: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def settle(condition: Any, timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


async def test_journal_and_postgres_both_failing_keep_records_in_memory_until_one_works(
    postgres_down: AsyncSessions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(tmp_path)
    recorder = Recorder(
        postgres_down, journal, batch_size=4, queue_max_bytes=2**30, retry_s=0.2, gamma=None
    )
    monkeypatch.setattr(journal, "append", disk_full)
    errors_before = metric("flywheel_journal_errors_total", operation="append")
    recorder.start()
    batch = records(10)
    recorder.submit(batch)
    await settle(lambda: recorder.journal_error is not None)
    await asyncio.sleep(0.5)  # a few retries of both
    assert recorder._task is not None and not recorder._task.done()  # the writer lives
    assert recorder.queue_depth == len(batch)  # all of them, in memory
    assert "append: " in (error := recorder.journal_error or "") and "No space left" in error
    assert metric("flywheel_journal_errors_total", operation="append") > errors_before
    assert metric("flywheel_journal_ok") == 0

    monkeypatch.undo()  # the disk has room again: they reach the journal, Postgres still down
    await settle(lambda: journal.pending == len(batch))
    assert recorder.queue_depth == 0 and recorder.journal_error is None
    await recorder.stop(timeout=2)
    kept = [r.id for s in journal.segments() for r in journal.read(s)]
    assert sorted(kept) == sorted(r.id for r in batch)


async def test_what_a_kill_would_lose_counts_the_batches_being_written(
    postgres_down: AsyncSessions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/chaos.py journal-full+proxy-kill lost 915 transitions where the queue gauge said
    405: each of the two writers held a batch of 500 it was trying to write, in no gauge."""
    recorder = Recorder(
        postgres_down,
        Journal(tmp_path),
        batch_size=4,
        queue_max_bytes=2**30,
        retry_s=0.2,
        gamma=None,
    )
    hang = asyncio.Event()

    async def hanging_insert(_: list[TransitionRecord]) -> None:
        await hang.wait()  # Postgres holding the write

    monkeypatch.setattr(recorder, "_insert", hanging_insert)
    recorder.start()
    recorder.submit(records(10))
    await settle(lambda: len(recorder._queue.in_flight) == 2)  # a batch of 4 each
    assert recorder.queue_depth == 2
    assert metric("flywheel_writer_unsaved_transitions") == 10
    hang.set()
    await settle(lambda: metric("flywheel_writer_unsaved_transitions") == 0)
    await recorder.stop(timeout=2)


async def test_a_failed_spill_keeps_the_queue_and_the_request_is_not_failed(
    postgres_down: AsyncSessions,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    journal = Journal(tmp_path)
    recorder = Recorder(
        postgres_down, journal, batch_size=4, queue_max_bytes=1, retry_s=5, gamma=None
    )
    monkeypatch.setattr(journal, "append", disk_full)
    recorder.start()
    batch = records(6)
    for r in batch:  # over queue_max: submit spills, the spill fails; nothing raises
        recorder.submit([r])
    assert recorder.queue_depth == len(batch)  # (the writer has not run yet: no await)
    assert recorder.journal_error is not None

    # Stopping with nowhere to put them: stop() does not raise; it says they are lost.
    with caplog.at_level(logging.CRITICAL, logger="proxy.record.recorder"):
        await recorder.stop(timeout=1)
    assert "6 recorded transitions could be written neither" in caplog.text


async def test_stop_saves_what_is_left_to_the_journal_when_postgres_is_down(
    postgres_down: AsyncSessions, tmp_path: Path
) -> None:
    journal = Journal(tmp_path)
    recorder = Recorder(
        postgres_down, journal, batch_size=4, queue_max_bytes=2**30, retry_s=5, gamma=None
    )
    recorder.start()
    batch = records(9)
    recorder.submit(batch)
    await recorder.stop(timeout=3)
    assert journal.pending == len(batch) and recorder.queue_depth == 0


def corrupt_segment(directory: Path, good: list[TransitionRecord]) -> Path:
    """A segment with a damaged line between good ones (written as a flaky disk would leave it)."""
    lines = [orjson.dumps(r) for r in good]
    lines.insert(1, b'{"id": "5f1c", "episode_id": \x00\xff garbage')
    lines.insert(2, b"[1, 2, 3]")
    path = directory / "segment-00000000000000000001-1-000001.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


async def test_a_corrupt_journal_line_is_quarantined_and_the_rest_replayed(
    database_url: str, tmp_path: Path
) -> None:
    good = records(3, seed=7)
    segment = corrupt_segment(tmp_path, good)
    original = segment.read_bytes()
    before = metric("flywheel_journal_quarantined_lines_total")
    engine, sessionmaker = database.create_async_sessions(database_url)
    journal = Journal(tmp_path)
    recorder = Recorder(
        sessionmaker, journal, batch_size=4, queue_max_bytes=2**30, retry_s=0.1, gamma=None
    )
    assert journal.pending == len(good)  # the two bad lines no longer count
    assert (tmp_path / "quarantine" / segment.name).read_bytes() == original
    assert journal.quarantined() == 1
    assert metric("flywheel_journal_quarantined_lines_total") == before + 2
    recorder.start()
    await settle(lambda: journal.pending == 0)
    await recorder.stop()
    async with sessionmaker() as session:
        ids = (await session.execute(text("SELECT id::text FROM transition"))).scalars()
        stored = set(ids)
    await engine.dispose()
    assert stored == {r.id for r in good}
    assert not segment.exists()  # replayed and removed; the copy stays in quarantine/


def chat(proxy: RunningProxy, episode: str) -> list[str]:
    body = {**CHAT, "n": 3}  # three records: over a writer_queue_max_bytes of 1, they spill at once
    r = proxy.client(**{"X-Episode-Id": episode}).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text  # vLLM answered; however the journal fares
    return r.headers["x-transition-id"].split(",")


def test_the_proxy_starts_on_a_corrupt_journal_and_health_shows_a_failing_journal(
    make_proxy: Any, fake_vllm: FakeVLLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal_dir = tmp_path / "home" / "journal"
    journal_dir.mkdir(parents=True)
    old = records(2, seed=9)
    corrupt_segment(journal_dir, old)
    proxy: RunningProxy = make_proxy(writer_queue_max_bytes=1, journal_retry_s=0.2)
    health = httpx.get(proxy.url + "/healthz")
    assert health.status_code == 200 and health.json()["journal_quarantined"] == 1

    journal = proxy.services.recorder.journal
    monkeypatch.setattr(journal, "append", disk_full)
    served = chat(proxy, "full")  # the spill fails: the writer takes them to Postgres instead
    health = httpx.get(proxy.url + "/healthz")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert "No space left" in health.json()["journal"]

    monkeypatch.undo()
    time.sleep(0.3)  # a failed spill is retried after journal_retry_s, not on every call
    served += chat(proxy, "room")  # this spill works: the journal is fine again
    assert httpx.get(proxy.url + "/healthz").json()["status"] == "ok"
    rows = proxy.wait_rows("SELECT id::text FROM transition", len(served) + len(old))
    assert sorted(i for (i,) in rows) == sorted(served + [r.id for r in old])


@pytest.mark.slow
def test_postgres_down_and_journal_failing_is_a_503_and_loses_nothing(
    own_postgres: Any, make_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = own_postgres.url
    # With a metrics key: the probe (no key) gets the status alone, with the same 503.
    proxy: RunningProxy = make_proxy(database_url=url, journal_retry_s=0.2, metrics_key="m")
    journal = proxy.services.recorder.journal
    monkeypatch.setattr(journal, "append", disk_full)
    own_postgres.stop()
    served = chat(proxy, "nowhere")
    deadline = time.monotonic() + 10
    while (health := httpx.get(proxy.url + "/healthz", headers=proxy.ops_auth)).status_code != 503:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.1)
    assert health.json()["status"] == "failing" and health.json()["writer_queue"] == 3
    probe = httpx.get(proxy.url + "/healthz")
    assert probe.status_code == 503 and probe.json() == {"status": "failing"}
    assert httpx.get(proxy.url + "/livez").status_code == 200  # drain it, do not restart it

    own_postgres.start()  # Postgres back, the disk still full: the records go straight there
    rows = proxy.wait_rows("SELECT id::text FROM transition", 3, timeout=30)
    assert sorted(i for (i,) in rows) == sorted(served)
    assert httpx.get(proxy.url + "/healthz").json() == {"status": "degraded"}


async def test_the_queue_is_bounded_in_bytes_so_long_prompts_spill_to_the_journal(
    postgres_down: AsyncSessions, tmp_path: Path
) -> None:
    """Issue 13, item 3: 200k transitions of a few thousand prompt tokens each were gigabytes
    held in memory before anything spilled; the bound is now what they weigh."""
    journal = Journal(tmp_path)
    recorder = Recorder(
        postgres_down, journal, batch_size=4, queue_max_bytes=2**20, retry_s=5, gamma=None
    )
    small = records(20)
    for r in small:
        r.prompt_token_ids = [7] * 50
    recorder.submit(small)  # ~20 x 3 KB: stays in memory
    assert recorder.queue_depth == 20 and journal.pending == 0
    long = records(1, seed=2)
    long[0].prompt_token_ids = list(range(30_000))  # ~1.2 MB as Python ints
    recorder.submit(long)
    assert recorder.queue_depth == 0 and journal.pending == 21  # all spilled, in order
    assert metric("flywheel_writer_queue_bytes") == 0
    assert [r.id for s in journal.segments() for r in journal.read(s)] == [
        r.id for r in small + long
    ]


def test_record_bytes_follows_what_records_hold_in_memory() -> None:
    """The estimate against tracemalloc, for short and long prompts (within a factor of 1.5)."""
    for prompt_tokens in (10, 4000):
        rng = random.Random(prompt_tokens)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        made = records(20, seed=prompt_tokens)
        for r in made:
            r.prompt_token_ids = [rng.randrange(1000, 150_000) for _ in range(prompt_tokens)]
            r.messages = orjson.loads(
                orjson.dumps([{"role": "user", "content": "x" * (4 * prompt_tokens)}])
            )
        held = (tracemalloc.get_traced_memory()[0] - before) / len(made)
        tracemalloc.stop()
        estimate = sum(map(record_bytes, made)) / len(made)
        assert held / 1.5 < estimate < held * 1.5, (prompt_tokens, held, estimate)


# --- durable mode (issue 13, item 4) ---------------------------------------------------------


def slow_writes(proxy: RunningProxy, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every write to Postgres takes `seconds` longer: the window a kill -9 would lose."""
    recorder = proxy.services.recorder
    insert = recorder._insert

    async def slow(records: list[TransitionRecord]) -> None:
        await asyncio.sleep(seconds)
        await insert(records)

    monkeypatch.setattr(recorder, "_insert", slow)


def stored(proxy: RunningProxy, transition_id: str) -> bool:
    return bool(proxy.query("SELECT 1 FROM transition WHERE id = %s", transition_id))


@pytest.mark.parametrize("durable", [False, True])
@pytest.mark.slow
def test_durable_mode_answers_only_once_the_transition_is_safe(
    make_proxy: Any, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    proxy: RunningProxy = make_proxy(durable=durable)
    slow_writes(proxy, monkeypatch, 0.5)
    with proxy.client(**{"X-Episode-Id": f"durable-{durable}"}) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        assert stored(proxy, r.headers["x-transition-id"]) is durable  # default: not yet
        # A stream: its [DONE] comes once the transition is stored.
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert stored(proxy, s.headers["x-transition-id"]) is durable
        # The Responses API: its response.completed event is the one held.
        with c.stream(
            "POST", "/v1/responses", json={"model": "demo", "input": "hi", "stream": True}
        ) as s:
            events = [line for line in s.iter_lines() if line.startswith("event: ")]
            assert events[-1] == "event: response.completed"
            assert stored(proxy, s.headers["x-transition-id"]) is durable


def test_durable_mode_counts_journaled_as_safe_and_times_out_when_neither_works(
    make_proxy: Any, monkeypatch: pytest.MonkeyPatch, postgres_down: AsyncSessions
) -> None:
    proxy: RunningProxy = make_proxy(durable=True, durable_wait_s=1.0, journal_retry_s=0.2)
    recorder = proxy.services.recorder
    monkeypatch.setattr(recorder, "_sessionmaker", postgres_down)
    with proxy.client(**{"X-Episode-Id": "durable-journal"}) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        journaled = [x.id for s in recorder.journal.segments() for x in recorder.journal.read(s)]
        assert r.headers["x-transition-id"] in journaled  # on disk before the answer
        before = metric("flywheel_durable_timeouts_total")
        monkeypatch.setattr(recorder.journal, "append", disk_full)
        started = time.monotonic()
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and time.monotonic() - started >= 1.0  # waited, then served
        assert metric("flywheel_durable_timeouts_total") == before + 1
