"""`AsyncFlywheel`: the client for asyncio, the same methods as `Flywheel` (flywheel/client/sync.py)
awaited. An episode is entered with `async with`; each asyncio task sees its own."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from flywheel.client.base import TRANSIENT, Call, ClientBase, Sent, T
from flywheel.client.episode import Episode, tag_client
from flywheel.client.records import (
    Demonstration,
    DemonstrationResult,
    EpisodeView,
    Reward,
    RewardResult,
)

if TYPE_CHECKING:
    import anthropic
    import openai


class AsyncFlywheel(ClientBase):
    """`AsyncFlywheel(base_url=None, api_key=None, *, retry=Retry(), timeout=60.0)`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self.config.headers(), timeout=self.timeout
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncFlywheel:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def episode(
        self,
        task: str | None = None,
        agent: str | None = None,
        episode_id: str | None = None,
        *,
        on_error: float | None = None,
    ) -> Episode:
        """A new episode to enter with `async with` (`with` too, without on_error)."""
        episode = self._episode(task, agent, episode_id, on_error)

        async def post(value: float, source: str) -> None:
            await self.reward(value, episode_id=episode.id, source=source)

        episode.post_async = post
        return episode

    def openai(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """An `openai.AsyncOpenAI` on the proxy whose calls carry the current episode's tags."""
        import openai

        kwargs.setdefault("base_url", self.base_url + "/v1")
        kwargs.setdefault("api_key", self.config.api_key or "unused")
        http = kwargs.pop("http_client", None) or openai.DefaultAsyncHttpxClient()
        return openai.AsyncOpenAI(http_client=tag_client(http), **kwargs)

    def anthropic(self, **kwargs: Any) -> anthropic.AsyncAnthropic:
        """An `anthropic.AsyncAnthropic` on the proxy (key as `Authorization: Bearer`)."""
        import anthropic

        kwargs.setdefault("base_url", self.base_url)
        kwargs.setdefault("auth_token", self.config.api_key or "unused")
        http = kwargs.pop("http_client", None) or anthropic.DefaultAsyncHttpxClient()
        return anthropic.AsyncAnthropic(http_client=tag_client(http), **kwargs)

    async def reward(
        self,
        value: float,
        *,
        episode_id: str | None = None,
        source: str | None = None,
        idempotency_key: str | None = None,
    ) -> RewardResult:
        return (await self.rewards([self._reward(value, episode_id, source, idempotency_key)]))[0]

    async def step_reward(
        self,
        value: float,
        *,
        transition_id: str | None = None,
        tool_call_id: str | None = None,
        episode_id: str | None = None,
        source: str | None = None,
        idempotency_key: str | None = None,
    ) -> RewardResult:
        item = self._step_reward(
            value, transition_id, tool_call_id, episode_id, source, idempotency_key
        )
        return (await self.rewards([item]))[0]

    async def rewards(self, items: Sequence[Reward]) -> list[RewardResult]:
        return await self._run(self._rewards_call(items))

    async def demonstrate(
        self,
        messages: list[dict[str, Any]],
        completion: str | dict[str, Any],
        **fields: Any,
    ) -> DemonstrationResult:
        """A prompt and the answer it should get, for the trainer to imitate; `fields` are
        Demonstration's (agent, lineage, tools, task_id, episode_id, idempotency_key)."""
        return (await self.demonstrations([Demonstration(messages, completion, **fields)]))[0]

    async def demonstrations(self, items: Sequence[Demonstration]) -> list[DemonstrationResult]:
        """Several in one post: all stored, or none (each keyed: a retry stores each once)."""
        return await self._run(self._demonstrations_call(items))

    async def demonstrate_episode(
        self,
        episode_id: str | None = None,
        *,
        agent: str | None = None,
        lineage: str | None = None,
    ) -> list[DemonstrationResult]:
        """Every call of a recorded episode (the open one unless given) as a demonstration,
        with its token ids as sampled: keep the episodes that went best (`agent`, `lineage`:
        only those calls). Copying an episode again adds nothing."""
        return await self._run(self._demonstrate_episode_call(episode_id, agent, lineage))

    async def episode_view(
        self, episode_id: str | None = None, *, tokens: bool = False
    ) -> EpisodeView:
        return await self._run(self._episode_view_call(episode_id, tokens))

    async def _run(self, call: Call[T]) -> T:
        tries = self._tries(call)
        wait = next(tries)
        while True:
            if wait:
                await asyncio.sleep(wait)
            sent: Sent
            try:
                sent = await self._http.request(
                    call.method, call.path, json=call.json, params=call.params
                )
            except TRANSIENT as e:
                sent = e
            try:
                wait = tries.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
