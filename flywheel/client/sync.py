"""`Flywheel`: the client for threads (`AsyncFlywheel`, flywheel/client/aio.py, for asyncio)."""

from __future__ import annotations

import time
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

if TYPE_CHECKING:  # imported when asked for: neither SDK is needed to post rewards
    import anthropic
    import openai


class Flywheel(ClientBase):
    """`Flywheel(base_url=None, api_key=None, *, retry=Retry(), timeout=60.0)`: arguments, else
    FLYWHEEL_BASE_URL and FLYWHEEL_API_KEY (flywheel/client/config.py). Thread-safe."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self.config.headers(), timeout=self.timeout
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Flywheel:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- tagging ---------------------------------------------------------------------------

    def episode(
        self,
        task: str | None = None,
        agent: str | None = None,
        episode_id: str | None = None,
        *,
        on_error: float | None = None,
    ) -> Episode:
        """A new episode (`episode_id`: a generated `ep-<hex>` unless given) to enter with
        `with`; `on_error`: a final reward posted if the block raises (else nothing is)."""
        episode = self._episode(task, agent, episode_id, on_error)
        episode.post_sync = lambda value, source: self.reward(
            value, episode_id=episode.id, source=source
        )
        return episode

    def openai(self, **kwargs: Any) -> openai.OpenAI:
        """An `openai.OpenAI` on the proxy whose calls carry the current episode's tags."""
        import openai

        kwargs.setdefault("base_url", self.base_url + "/v1")
        kwargs.setdefault("api_key", self.config.api_key or "unused")
        http = kwargs.pop("http_client", None) or openai.DefaultHttpxClient()
        return openai.OpenAI(http_client=tag_client(http), **kwargs)

    def anthropic(self, **kwargs: Any) -> anthropic.Anthropic:
        """An `anthropic.Anthropic` on the proxy (its key sent as `Authorization: Bearer`, as
        the proxy reads it) whose calls carry the current episode's tags."""
        import anthropic

        kwargs.setdefault("base_url", self.base_url)
        kwargs.setdefault("auth_token", self.config.api_key or "unused")
        http = kwargs.pop("http_client", None) or anthropic.DefaultHttpxClient()
        return anthropic.Anthropic(http_client=tag_client(http), **kwargs)

    # --- rewards and episodes --------------------------------------------------------------

    def reward(
        self,
        value: float,
        *,
        episode_id: str | None = None,
        source: str | None = None,
        idempotency_key: str | None = None,
    ) -> RewardResult:
        """The episode's final reward (a later one replaces it). `episode_id`: the current
        episode's unless given; `idempotency_key`: a new one unless given, sent on every retry."""
        return self.rewards([self._reward(value, episode_id, source, idempotency_key)])[0]

    def step_reward(
        self,
        value: float,
        *,
        transition_id: str | None = None,
        tool_call_id: str | None = None,
        episode_id: str | None = None,
        source: str | None = None,
        idempotency_key: str | None = None,
    ) -> RewardResult:
        """An intermediate reward for one call (its X-Transition-Id, e.g. from
        `episode.transition_ids`) or for the call that made tool call `tool_call_id`."""
        item = self._step_reward(
            value, transition_id, tool_call_id, episode_id, source, idempotency_key
        )
        return self.rewards([item])[0]

    def rewards(self, items: Sequence[Reward]) -> list[RewardResult]:
        """Several rewards in one post: all stored (or journaled), or none."""
        return self._run(self._rewards_call(items))

    def demonstrate(
        self,
        messages: list[dict[str, Any]],
        completion: str | dict[str, Any],
        **fields: Any,
    ) -> DemonstrationResult:
        """A prompt and the answer it should get, for the trainer to imitate; `fields` are
        Demonstration's (agent, lineage, tools, task_id, episode_id, idempotency_key)."""
        return self.demonstrations([Demonstration(messages, completion, **fields)])[0]

    def demonstrations(self, items: Sequence[Demonstration]) -> list[DemonstrationResult]:
        """Several in one post: all stored, or none (each keyed: a retry stores each once)."""
        return self._run(self._demonstrations_call(items))

    def demonstrate_episode(
        self,
        episode_id: str | None = None,
        *,
        agent: str | None = None,
        lineage: str | None = None,
    ) -> list[DemonstrationResult]:
        """Every call of a recorded episode (the open one unless given) as a demonstration,
        with its token ids as sampled: keep the episodes that went best (`agent`, `lineage`:
        only those calls). Copying an episode again adds nothing."""
        return self._run(self._demonstrate_episode_call(episode_id, agent, lineage))

    def episode_view(self, episode_id: str | None = None, *, tokens: bool = False) -> EpisodeView:
        """The episode as stored: its calls (tags, text, tool calls, returns) and rewards."""
        return self._run(self._episode_view_call(episode_id, tokens))

    def _run(self, call: Call[T]) -> T:
        tries = self._tries(call)
        wait = next(tries)
        while True:
            if wait:
                time.sleep(wait)
            sent: Sent
            try:
                sent = self._http.request(
                    call.method, call.path, json=call.json, params=call.params
                )
            except TRANSIENT as e:
                sent = e
            try:
                wait = tries.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
