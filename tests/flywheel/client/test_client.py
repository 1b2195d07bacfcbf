"""flywheel.client against a real running proxy (the fake vLLM answers) with the real openai SDK:
episodes tag the calls made inside them, rewards reach them, retries on a busy or silent proxy
store a reward once, a journaled 202 is a success, and every error says what to do.

A small front server (`Front`) stands between the client and the proxy where a test needs the
proxy to answer 503, 429 or nothing at all.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest

from demo.vllm_server import free_port
from flywheel.client import (
    AsyncFlywheel,
    AuthenticationError,
    EpisodeNotFound,
    Flywheel,
    IdempotencyKeyReused,
    ProxyUnavailable,
    RequestRejected,
    Retry,
    Reward,
    current,
)
from flywheel.client import episode as client_episode
from flywheel.client.config import Config
from proxy.config import TAG_PATTERN
from tests.conftest import RunningProxy

CHAT: dict[str, Any] = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
SLOW_S = 1.5  # a "slow" answer of the front: past a client's timeout of 0.5 s
FAST = Retry(attempts=4, backoff_s=0.01, backoff_max_s=0.05)


def chat(llm: openai.OpenAI) -> Any:
    return llm.chat.completions.with_raw_response.create(**CHAT, max_tokens=2)


def rows(proxy: RunningProxy, episode_id: str, n: int) -> list[Any]:
    return proxy.wait_rows(
        "SELECT agent_name, task_id, id::text FROM transition WHERE episode_id = %s "
        "ORDER BY requested_at",
        n,
        episode_id,
    )


# --- a front that answers for the proxy, or passes the request on --------------------------


class Front:
    """Answers each request by the next of `script`: "503", "429" (Retry-After: 0), "drop" (pass
    it to the proxy, then close the connection unanswered: the answer lost), "slow" (pass it
    after SLOW_S), "pass"; once the script is spent, every request passes. `seen` keeps each
    request's (path, body)."""

    def __init__(self, target: str, script: list[str]) -> None:
        self.target, self.script = target, list(script)
        self.seen: list[tuple[str, Any]] = []
        self.done = 0  # requests handled to the end (a "slow" one after its client left)
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                front.handle(self, b"")

            def do_POST(self) -> None:
                try:
                    front.handle(self, self.rfile.read(int(self.headers["Content-Length"])))
                finally:
                    front.done += 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, h: BaseHTTPRequestHandler, body: bytes) -> None:
        self.seen.append((h.path, json.loads(body) if body else None))
        step = self.script.pop(0) if self.script else "pass"
        if step in ("503", "429"):
            out = b'{"error": {"message": "busy", "type": "x", "param": null, "code": null}}'
            h.send_response(int(step))
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(out)))
            if step == "429":
                h.send_header("Retry-After", "0")
            h.end_headers()
            h.wfile.write(out)
            return
        if step == "slow":
            time.sleep(SLOW_S)
        headers = {
            k: v for k, v in h.headers.items() if k.lower() in ("content-type", "authorization")
        }
        answer = httpx.request(h.command, self.target + h.path, content=body, headers=headers)
        if step == "drop":
            h.close_connection = True
            return
        h.send_response(answer.status_code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(answer.content)))
        h.end_headers()
        h.wfile.write(answer.content)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def front(proxy: RunningProxy) -> Iterator[Any]:
    made: list[Front] = []

    def make(script: list[str]) -> Front:
        made.append(Front(proxy.url, script))
        return made[-1]

    yield make
    for f in made:
        f.close()


# --- the package itself ------------------------------------------------------------------


def test_importing_the_client_imports_neither_the_proxy_nor_sqlalchemy_nor_torch() -> None:
    heavy = ["proxy", "core", "trainer", "sqlalchemy", "torch", "fastapi", "pydantic", "openai"]
    code = (
        "import sys, flywheel.client; "
        f"print([m for m in sys.modules if m.split('.')[0] in {heavy!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_its_tag_rule_is_the_proxys() -> None:
    assert client_episode.TAG.pattern == TAG_PATTERN
    with pytest.raises(ValueError, match="invalid task_id 'a/b'"):
        Flywheel("http://127.0.0.1:1").episode(task="a/b")


def test_the_address_and_key_come_from_arguments_else_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLYWHEEL_BASE_URL", "http://proxy.example:8000/v1/")
    monkeypatch.setenv("FLYWHEEL_API_KEY", "fw_from_env")
    assert Config.resolve(None, None) == Config("http://proxy.example:8000", "fw_from_env")
    assert Config.resolve("http://other:1", "k") == Config("http://other:1", "k")
    monkeypatch.delenv("FLYWHEEL_BASE_URL")
    monkeypatch.delenv("FLYWHEEL_API_KEY")
    monkeypatch.setenv("OPENAI_BASE_URL", "https://api.openai.com/v1")  # never a fallback
    assert Config.resolve(None, None) == Config("http://127.0.0.1:8000", None)
    with pytest.raises(ValueError, match="FLYWHEEL_BASE_URL"):
        Config.resolve("127.0.0.1:8000", None)


# --- tagging -----------------------------------------------------------------------------


def test_an_episode_tags_the_openai_calls_inside_it_and_its_rewards_reach_them(
    proxy: RunningProxy,
) -> None:
    with Flywheel(proxy.url) as fw, fw.openai(max_retries=0) as llm:
        alone = chat(llm)  # outside any episode: a one-call episode of its own
        with fw.episode(task="t7", agent="planner") as ep:
            assert current() is ep and ep.id.startswith("ep-")
            chat(llm)
            with ep.agent("critic") as critic:  # another agent, the same episode
                assert current() is critic and critic.id == ep.id
                chat(llm)
            chat(llm)
            final = fw.reward(1.0)  # the open episode's
            step = fw.step_reward(0.5, transition_id=ep.transition_ids[1], source="critic")
        assert current() is None
        view = fw.episode_view(ep.id)

    assert alone.headers["x-episode-id"] != ep.id
    stored = rows(proxy, ep.id, 3)
    assert [(a, t) for a, t, _ in stored] == [
        ("planner", "t7"),
        ("critic", "t7"),
        ("planner", "t7"),
    ]
    assert ep.transition_ids == [tid for *_, tid in stored]  # noted from each answer, in order
    assert (final.status, final.stored, final.journaled) == ("accepted", True, False)
    assert final.credited_transitions == 3 and final.episode_id == ep.id
    assert (step.status, step.transition_id, step.source) == ("accepted", stored[1][2], "critic")

    assert view.id == ep.id and view.task_id == "t7" and view.final_reward == 1.0
    assert [t.agent_name for t in view.transitions] == ["planner", "critic", "planner"]
    assert [t.return_ for t in view.transitions] == [1.0, 1.5, 1.0]
    keys = {r.idempotency_key for r in view.rewards}
    assert len(keys) == 2 and all(k and k.startswith("fw-") for k in keys)  # made for each


def test_headers_and_the_path_form_for_clients_that_take_only_those(proxy: RunningProxy) -> None:
    with Flywheel(proxy.url) as fw:
        ep = fw.episode(task="t1", agent="solver", episode_id="e-path")
        assert ep.base_url == f"{proxy.url}/episode/e-path/task/t1/agent/solver/v1"
        assert ep.headers == {"X-Episode-Id": "e-path", "X-Task-Id": "t1", "X-Agent-Name": "solver"}
        with openai.OpenAI(base_url=ep.base_url, api_key="unused") as by_path:
            chat(by_path)
        with openai.OpenAI(
            base_url=proxy.v1, api_key="unused", default_headers=ep.agent("checker").headers
        ) as by_headers:
            chat(by_headers)
    assert [(a, t) for a, t, _ in rows(proxy, "e-path", 2)] == [("solver", "t1"), ("checker", "t1")]


def test_a_call_s_own_header_wins_over_the_episode_s(proxy: RunningProxy) -> None:
    with Flywheel(proxy.url) as fw, fw.openai() as llm, fw.episode(agent="a") as ep:
        llm.chat.completions.create(**CHAT, max_tokens=2, extra_headers={"X-Agent-Name": "b"})
    assert [a for a, *_ in rows(proxy, ep.id, 1)] == ["b"]


async def test_async_episodes_tag_concurrent_tasks_each_with_its_own(proxy: RunningProxy) -> None:
    async with AsyncFlywheel(proxy.url) as fw:
        llm = fw.openai(max_retries=0)

        async def play(task: str) -> str:
            async with fw.episode(task=task, agent="solver") as ep:
                for _ in range(2):
                    await llm.chat.completions.create(**CHAT, max_tokens=2)
                    await asyncio.sleep(0)  # the other episode's calls in between
                async with ep.agent("judge"):
                    await llm.chat.completions.create(**CHAT, max_tokens=2)
                result = await fw.reward(0.25)
                assert result.status == "accepted" and result.credited_transitions == 3
                step = await fw.step_reward(-0.5, transition_id=ep.transition_ids[0])
                assert step.transition_id == ep.transition_ids[0]
            return ep.id

        ids = await asyncio.gather(*(play(f"task-{i}") for i in range(3)))
        views = [await fw.episode_view(i) for i in ids]
        await llm.close()
    for i, view in enumerate(views):
        assert [(t.agent_name, t.task_id) for t in view.transitions] == [
            ("solver", f"task-{i}"),
            ("solver", f"task-{i}"),
            ("judge", f"task-{i}"),
        ]
        assert sorted(r.value for r in view.rewards) == [-0.5, 0.25]


async def test_one_episode_entered_by_two_tasks_and_two_threads_undoes_each_entry() -> None:
    """Found by reading: the entry tokens lived in a list on the shared Episode, so one task's
    exit reset another's token (ValueError: created in a different Context) and the episode
    stayed tagged on later calls. Each context undoes its own entry now."""
    ep = client_episode.Episode("ep-shared", "t", "solver", "http://proxy")
    first_in, second_in, first_out = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def first() -> None:
        async with ep:
            first_in.set()
            await second_in.wait()
        first_out.set()  # left while the second is still inside
        assert client_episode.current() is None

    async def second() -> None:
        await first_in.wait()
        async with ep:
            second_in.set()
            await first_out.wait()
            assert client_episode.current() is ep
        assert client_episode.current() is None

    await asyncio.gather(first(), second())
    assert client_episode.current() is None

    ins, outs, errors = [threading.Event() for _ in range(2)], threading.Event(), []

    def thread(n: int) -> None:
        try:
            if n == 1:
                ins[0].wait(timeout=10)
            with ep:
                ins[n].set()
                if n == 0:
                    ins[1].wait(timeout=10)
                else:
                    outs.wait(timeout=10)
                    assert client_episode.current() is ep
            if n == 0:
                outs.set()
            assert client_episode.current() is None
        except Exception as e:  # reported below, from the test's thread
            errors.append(e)

    threads = [threading.Thread(target=thread, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with ep, ep.agent("judge") as judge:  # nested entries still unwind innermost first
        assert client_episode.current() is judge
    assert client_episode.current() is None


def test_an_episode_that_raises_posts_nothing_unless_asked(proxy: RunningProxy) -> None:
    with Flywheel(proxy.url) as fw, fw.openai() as llm:
        with pytest.raises(RuntimeError), fw.episode(task="t") as quiet:
            chat(llm)
            raise RuntimeError("the tool crashed")
        with pytest.raises(RuntimeError), fw.episode(task="t", on_error=0.0) as scored:
            chat(llm)
            raise RuntimeError("the tool crashed")
        assert fw.episode_view(quiet.id).rewards == []
        [posted] = fw.episode_view(scored.id).rewards
    assert (posted.value, posted.source) == (0.0, "error")


def test_the_anthropic_client_carries_the_tags_and_the_key_as_a_bearer() -> None:
    import anthropic  # pinned in the lock: missing is an error, not a skip

    seen: list[dict[str, str]] = []
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "policy",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }

    class Handler(BaseHTTPRequestHandler):  # stands in for a proxy that serves /v1/messages
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
            out = json.dumps(message).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fw = Flywheel(f"http://127.0.0.1:{server.server_port}", api_key="fw_key")
        claude = fw.anthropic(max_retries=0)
        assert isinstance(claude, anthropic.Anthropic)
        with fw.episode(task="t", agent="writer", episode_id="e-claude"):
            claude.messages.create(
                model="policy", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        claude.close()
        fw.close()
    finally:
        server.shutdown()
        server.server_close()
    [request] = seen
    assert request["path"] == "/v1/messages"
    assert request["x-episode-id"] == "e-claude" and request["x-task-id"] == "t"
    assert request["x-agent-name"] == "writer"
    assert request["authorization"] == "Bearer fw_key"


# --- retries and idempotency -----------------------------------------------------------------


def test_a_reward_is_retried_through_503_and_429_with_one_key(
    proxy: RunningProxy, front: Any
) -> None:
    busy = front(["503", "429", "503"])
    with Flywheel(busy.url, retry=FAST) as fw:
        result = fw.reward(1.0, episode_id="e-retry")
    assert result.status == "accepted"
    bodies = [body for _, body in busy.seen]
    assert len(bodies) == 4 and len({b["idempotency_key"] for b in bodies}) == 1
    assert proxy.query("SELECT value FROM reward WHERE episode_id = 'e-retry'") == [(1.0,)]


async def test_a_reward_whose_answer_was_lost_is_stored_once(
    proxy: RunningProxy, front: Any
) -> None:
    lossy = front(["drop", "drop"])  # stored by the proxy twice over, answered neither time
    async with AsyncFlywheel(lossy.url, retry=FAST) as fw:
        result = await fw.reward(0.5, episode_id="e-lost", source="judge")
    assert result.status == "duplicate" and result.stored
    assert len(lossy.seen) == 3
    assert proxy.query("SELECT value, source FROM reward WHERE episode_id = 'e-lost'") == [
        (0.5, "judge")
    ]


@pytest.mark.slow
def test_a_reward_that_timed_out_is_retried_and_stored_once(
    proxy: RunningProxy, front: Any
) -> None:
    slow = front(["slow"])
    with Flywheel(slow.url, retry=FAST, timeout=0.5) as fw:
        result = fw.reward(1.0, episode_id="e-slow")
    assert result.status in ("accepted", "duplicate") and len(slow.seen) >= 2
    proxy.wait_until(lambda: slow.done == len(slow.seen), "the first try reaching the proxy")
    assert proxy.query("SELECT value FROM reward WHERE episode_id = 'e-slow'") == [(1.0,)]


def test_an_unreachable_or_ever_busy_proxy_is_named_after_the_retries(front: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Flywheel(url, retry=FAST) as fw, pytest.raises(ProxyUnavailable) as lost:
        fw.reward(1.0, episode_id="e")
    assert f"no answer from the Flywheel proxy at {url}/v1/rewards after 4 attempt(s)" in str(
        lost.value
    )
    assert "FLYWHEEL_BASE_URL" in str(lost.value)

    busy = front(["503"] * 3)
    with (
        Flywheel(busy.url, retry=Retry(attempts=3, backoff_s=0.01)) as fw,
        pytest.raises(ProxyUnavailable, match="still answered 503 after 3 attempt"),
    ):
        fw.reward(1.0, episode_id="e")
    assert len(busy.seen) == 3  # bounded


def test_a_reward_journaled_during_an_outage_is_a_success(make_proxy: Any) -> None:
    down = make_proxy(database_url=f"postgresql+psycopg://x@127.0.0.1:{free_port()}/x")
    with Flywheel(down.url, retry=FAST) as fw:
        result = fw.reward(1.0, episode_id="e-outage")
        [step, final] = fw.rewards(
            [
                Reward("e-outage", 0.5, tool_call_id="call_1", source="tool"),
                Reward("e-outage", 1.0, idempotency_key="final"),
            ]
        )
    assert (result.status, result.stored, result.journaled) == ("journaled", False, True)
    assert step.journaled and final.journaled and step.source == "tool"


# --- errors --------------------------------------------------------------------------------


def test_errors_say_what_to_do(make_proxy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = make_proxy(api_keys=["right"])
    with Flywheel(proxy.url, api_key="wrong") as fw, pytest.raises(AuthenticationError) as e:
        fw.reward(1.0, episode_id="e")
    assert e.value.status == 401 and "Set FLYWHEEL_API_KEY" in str(e.value)

    monkeypatch.setenv("FLYWHEEL_API_KEY", "right")
    with Flywheel(proxy.url) as fw:
        with pytest.raises(EpisodeNotFound, match="episode 'nobody'"):
            fw.episode_view("nobody")
        unseen = fw.step_reward(1.0, episode_id="later", transition_id=str(uuid.uuid4()))
        assert unseen.status == "pending"  # its transition may be on another replica's way
        with fw.openai() as llm, fw.episode() as ep:
            chat(llm)
        with pytest.raises(EpisodeNotFound, match="episode 'nobody'") as step:
            fw.step_reward(1.0, episode_id="nobody", transition_id=ep.transition_ids[0])
        assert step.value.code == "transition_not_found"
        fw.reward(1.0, episode_id="e-key", idempotency_key="k")
        assert fw.reward(1.0, episode_id="e-key", idempotency_key="k").status == "duplicate"
        with pytest.raises(IdempotencyKeyReused, match="needs its own idempotency_key"):
            fw.reward(0.0, episode_id="e-key", idempotency_key="k")
        with pytest.raises(RequestRejected, match="400") as bad:
            fw.reward(1.0, episode_id="e-key", source="air")
        assert bad.value.status == 400
        with pytest.raises(ValueError, match="no episode"):
            fw.reward(1.0)
        with pytest.raises(ValueError, match="transition_id or tool_call_id"):
            fw.step_reward(1.0, episode_id="e-key")


# --- the demo agents post through it -------------------------------------------------------


def test_the_demo_agent_tags_its_calls_and_posts_its_rewards_with_the_client(
    proxy: RunningProxy,
) -> None:
    from demo.agent import Agent

    agent = Agent(proxy.url, concurrency=2)
    try:
        episodes = agent.round(questions=1, samples=2)
    finally:
        agent.close()
    assert [e.failed for e in episodes] == [None, None]
    for e in episodes:
        assert [(a, t) for a, t, _ in rows(proxy, e.episode_id, 1)] == [("calculator", e.task_id)]
        stored = proxy.query(
            "SELECT value, idempotency_key FROM reward WHERE episode_id = %s", e.episode_id
        )
        assert stored == [(e.reward, e.episode_id)]


async def test_the_tool_agent_tags_its_calls_and_posts_its_rewards_with_the_client(
    proxy: RunningProxy,
) -> None:
    from demo.tool_agent import AGENT_NAME, ToolAgent

    agent = ToolAgent(proxy.url, concurrency=2)
    try:
        episodes = await agent.round(questions=1, samples=2)
    finally:
        await agent.close()
    assert [e.failed for e in episodes] == [None, None]
    for e in episodes:
        assert e.turns >= 1
        calls = rows(proxy, e.episode_id, e.turns)
        assert [(a, t) for a, t, _ in calls] == [(AGENT_NAME, e.task_id)] * e.turns
        stored = proxy.query(
            "SELECT value FROM reward WHERE episode_id = %s AND idempotency_key = %s",
            e.episode_id,
            e.episode_id,
        )
        assert stored == [(e.reward,)]
