"""`Flywheel`: the client for threads (`AsyncFlywheel`, flywheel/client/aio.py, for asyncio)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from flywheel.client.base import TRANSIENT, ClientBase, single
from flywheel.client.episode import Episode, tag_client
from flywheel.client.records import (
    Demonstration,
    DemonstrationResult,
    EpisodeView,
    Reward,
    RewardResult,
    demonstration_results,
    reward_results,
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
        if (transition_id is None) == (tool_call_id is None):
            raise ValueError("step_reward: give transition_id or tool_call_id (one of them)")
        item = self._reward(value, episode_id, source, idempotency_key, transition_id, tool_call_id)
        return self.rewards([item])[0]

    def rewards(self, items: Sequence[Reward]) -> list[RewardResult]:
        """Several rewards in one post: all stored (or journaled), or none."""
        if not items:
            raise ValueError("rewards([]): nothing to post")
        episode_id = items[0].episode_id
        body = self._send("POST", "/v1/rewards", episode_id, json=single(list(items)))
        return reward_results(body)

    def demonstrate(
        self,
        messages: list[dict[str, Any]],
        completion: str | dict[str, Any],
        **fields: Any,
    ) -> DemonstrationResult:
        """A prompt and the answer it should get, for the trainer to imitate; `fields` are
        Demonstration's (agent, lineage, tools, task_id, episode_id, idempotency_key)."""
        return (self.demonstrations([Demonstration(messages, completion, **fields)]))[0]

    def demonstrations(self, items: Sequence[Demonstration]) -> list[DemonstrationResult]:
        """Several in one post: all stored, or none (each keyed: a retry stores each once)."""
        if not items:
            raise ValueError("demonstrations([]): nothing to post")
        body = [d.body() for d in items] if len(items) > 1 else items[0].body()
        return demonstration_results(self._send("POST", "/v1/demonstrations", None, json=body))

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
        episode_id = self._episode_id(episode_id)
        body: dict[str, Any] = {"from_episode": episode_id}
        body |= {k: v for k, v in (("agent", agent), ("lineage", lineage)) if v is not None}
        return demonstration_results(
            self._send("POST", "/v1/demonstrations", episode_id, json=body)
        )

    def episode_view(self, episode_id: str | None = None, *, tokens: bool = False) -> EpisodeView:
        """The episode as stored: its calls (tags, text, tool calls, returns) and rewards."""
        episode_id = self._episode_id(episode_id)
        params = {"tokens": "true"} if tokens else None
        body = self._send("GET", f"/v1/episodes/{episode_id}", episode_id, params=params)
        return EpisodeView.from_json(body)

    def _send(self, method: str, path: str, episode_id: str | None, **kwargs: Any) -> Any:
        last: httpx.Response | None = None
        last_error = ""
        for attempt in range(1, self.retry.attempts + 1):
            try:
                last = self._http.request(method, path, **kwargs)
            except TRANSIENT as e:
                last, last_error = None, f"{type(e).__name__}: {e}"
            else:
                if not self._retryable(last):
                    return self._answer(last, episode_id)
            if attempt < self.retry.attempts:
                retry_after = last.headers.get("retry-after") if last is not None else None
                time.sleep(self.retry.delay(attempt, retry_after))
        raise self._give_up(path, last, last_error)
