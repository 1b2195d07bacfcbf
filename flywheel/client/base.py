"""What the sync and the async client share: their configuration, the episodes they open, the
rewards they build, and how an answer of the proxy becomes a result, an error or a retry."""

from __future__ import annotations

from typing import Any

import httpx

from flywheel.client import errors
from flywheel.client.config import DEFAULT_TIMEOUT_S, RETRY_STATUSES, Config, Retry
from flywheel.client.episode import Episode, current, new_episode_id
from flywheel.client.records import Reward, new_key

# Errors of the way there, worth another try (an unknown scheme or a bad URL is not).
TRANSIENT = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


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


def single(rewards: list[Reward]) -> dict[str, Any] | list[dict[str, Any]]:
    """One reward as an object, several as a list (all or nothing)."""
    return rewards[0].body() if len(rewards) == 1 else [r.body() for r in rewards]
