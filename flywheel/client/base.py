"""What the sync and the async client share: everything but the I/O. Each method of theirs asks
this base for a `Call` (what to send, and how the answer becomes the result) and runs it through
`tries`, the retry loop without its I/O: `Flywheel` sends and sleeps with httpx.Client and
time.sleep, `AsyncFlywheel` with httpx.AsyncClient and asyncio.sleep, and nothing else differs."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx

from flywheel.client import errors
from flywheel.client.config import DEFAULT_TIMEOUT_S, RETRY_STATUSES, Config, Retry
from flywheel.client.episode import Episode, current, new_episode_id
from flywheel.client.records import (
    Demonstration,
    DemonstrationResult,
    EpisodeView,
    Reward,
    RewardResult,
    demonstration_results,
    new_key,
    reward_results,
)

# Errors of the way there, worth another try (an unknown scheme or a bad URL is not).
TRANSIENT = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)

T = TypeVar("T")

# What one try got: the proxy's response, or a TRANSIENT error on the way there.
Sent = httpx.Response | Exception


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request to the proxy, planned: what is sent, and how its answer becomes the result."""

    method: str
    path: str
    episode_id: str | None  # named in the error, if the proxy refuses
    parse: Callable[[Any], T]
    json: Any = None
    params: dict[str, str] | None = None


class ClientBase:
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        retry: Retry | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.config = Config.resolve(base_url, api_key)
        self.retry = retry or Retry()
        self.timeout = timeout

    @property
    def base_url(self) -> str:
        """The proxy's root URL (no /v1)."""
        return self.config.base_url

    def _episode(
        self, task: str | None, agent: str | None, episode_id: str | None, on_error: float | None
    ) -> Episode:
        return Episode(
            episode_id or new_episode_id(), task, agent, self.base_url, on_error=on_error
        )

    def _reward(
        self,
        value: float,
        episode_id: str | None,
        source: str | None,
        idempotency_key: str | None,
        transition_id: str | None = None,
        tool_call_id: str | None = None,
    ) -> Reward:
        return Reward(
            self._episode_id(episode_id),
            value,
            transition_id=transition_id,
            tool_call_id=tool_call_id,
            source=source,
            idempotency_key=idempotency_key or new_key(),
        )

    def _episode_id(self, episode_id: str | None) -> str:
        """`episode_id`, else the id of the episode open here."""
        if episode_id is not None:
            return episode_id
        open_episode = current()
        if open_episode is None:
            raise ValueError("no episode: pass episode_id=, or call inside `with fw.episode(...)`")
        return open_episode.id

    # --- the calls ------------------------------------------------------------------------

    def _rewards_call(self, items: Sequence[Reward]) -> Call[list[RewardResult]]:
        if not items:
            raise ValueError("rewards([]): nothing to post")
        body = single(items)
        return Call("POST", "/v1/rewards", items[0].episode_id, reward_results, json=body)

    def _step_reward(
        self,
        value: float,
        transition_id: str | None,
        tool_call_id: str | None,
        episode_id: str | None,
        source: str | None,
        idempotency_key: str | None,
    ) -> Reward:
        if (transition_id is None) == (tool_call_id is None):
            raise ValueError("step_reward: give transition_id or tool_call_id (one of them)")
        return self._reward(value, episode_id, source, idempotency_key, transition_id, tool_call_id)

    def _demonstrations_call(
        self, items: Sequence[Demonstration]
    ) -> Call[list[DemonstrationResult]]:
        if not items:
            raise ValueError("demonstrations([]): nothing to post")
        return Call("POST", "/v1/demonstrations", None, demonstration_results, json=single(items))

    def _demonstrate_episode_call(
        self, episode_id: str | None, agent: str | None, lineage: str | None
    ) -> Call[list[DemonstrationResult]]:
        episode_id = self._episode_id(episode_id)
        body: dict[str, Any] = {"from_episode": episode_id}
        body |= {k: v for k, v in (("agent", agent), ("lineage", lineage)) if v is not None}
        return Call("POST", "/v1/demonstrations", episode_id, demonstration_results, json=body)

    def _episode_view_call(self, episode_id: str | None, tokens: bool) -> Call[EpisodeView]:
        episode_id = self._episode_id(episode_id)
        params = {"tokens": "true"} if tokens else None
        path = f"/v1/episodes/{episode_id}"
        return Call("GET", path, episode_id, EpisodeView.from_json, params=params)

    # --- trying -----------------------------------------------------------------------------

    def _tries(self, call: Call[T]) -> Generator[float, Sent, T]:
        """The retry loop without its I/O: yields how long to wait before each try (0 before the
        first), is sent what the try got, returns the answer parsed or raises the error (the
        proxy's refusal, or `ProxyUnavailable` once the attempts are spent)."""
        last: httpx.Response | None = None
        last_error, wait = "", 0.0
        for attempt in range(1, self.retry.attempts + 1):
            sent = yield wait
            if isinstance(sent, httpx.Response):
                last = sent
                if not self._retryable(sent):
                    return call.parse(self._answer(sent, call.episode_id))
            else:
                last, last_error = None, f"{type(sent).__name__}: {sent}"
            retry_after = last.headers.get("retry-after") if last is not None else None
            wait = self.retry.delay(attempt, retry_after)
        raise self._give_up(call.path, last, last_error)

    def _url(self, path: str) -> str:
        return self.config.base_url + path

    def _answer(self, response: httpx.Response, episode_id: str | None) -> Any:
        """The JSON of a 200 or 202 (a journaled reward is a success); an error raised."""
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code in (200, 202):
            return body
        raise errors.from_response(
            response.status_code, body, str(response.request.url), episode_id=episode_id
        )

    def _retryable(self, response: httpx.Response) -> bool:
        return response.status_code in RETRY_STATUSES

    def _give_up(
        self, path: str, last: httpx.Response | None, last_error: str
    ) -> errors.ProxyUnavailable:
        attempts = self.retry.attempts
        if last is not None:
            return errors.busy(self._url(path), attempts, last.status_code, last.text)
        return errors.unreachable(self._url(path), attempts, last_error)


def single(items: Sequence[Reward] | Sequence[Demonstration]) -> Any:
    """One item as an object, several as a list (all or nothing), as both routes take them."""
    return items[0].body() if len(items) == 1 else [item.body() for item in items]
