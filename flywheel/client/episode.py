"""An episode's tags (X-Episode-Id, X-Task-Id, X-Agent-Name) put on every call made inside it.

`with fw.episode(task=..., agent=...) as ep:` makes `ep` the current episode of this thread or
asyncio task (a context variable: tasks started inside inherit it, other threads do not). An
OpenAI or Anthropic client from `fw.openai()` / `fw.anthropic()`, or any httpx client passed
through `tag_client`, reads it on every request: its request hook adds the headers the call does
not set itself, and its response hook notes the call's X-Transition-Id in `ep.transition_ids`.
For frameworks that take only headers there is `ep.headers`; for those that take only a base URL,
`ep.base_url` (the path form: `/episode/<id>/task/<task>/agent/<agent>/v1`).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, TypeVar

log = logging.getLogger(__name__)

# The proxy's TAG_PATTERN (proxy/config/relay.py; tests/flywheel/client/test_client.py holds them
# equal), checked here so that a bad tag fails where it is made, not at the first call.
TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,199}$")
HEADERS = {"id": "X-Episode-Id", "task_id": "X-Task-Id", "agent_name": "X-Agent-Name"}
PATH_KEYS = {"id": "episode", "task_id": "task", "agent_name": "agent"}
ON_ERROR_SOURCE = "error"  # the source of the reward `on_error` posts

_current: ContextVar[Episode | None] = ContextVar("flywheel_episode", default=None)
# The episodes entered in this context, innermost last, each with the token that undoes its entry.
# Per context, not on the Episode: two tasks or threads entering one episode each undo their own.
_entered: ContextVar[tuple[tuple[Episode, Token[Episode | None]], ...]] = ContextVar(
    "flywheel_entered", default=()
)


def current() -> Episode | None:
    """The episode open in this context (the innermost `with`), if any."""
    return _current.get()


def new_episode_id() -> str:
    return f"ep-{uuid.uuid4().hex}"


def check_tag(name: str, value: str | None) -> None:
    if value is not None and not TAG.fullmatch(value):
        raise ValueError(
            f"invalid {name} {value[:80]!r}: 1-200 characters of letters, digits and ._:@+=-, "
            "starting with a letter or digit (the proxy's rule for tags)"
        )


@dataclass(eq=False)
class Episode:
    """One episode: its id, task and the agent now calling. Enter it (`with` or `async with`) to
    tag the calls made inside; `agent(name)` is the same episode under another agent's name."""

    id: str
    task_id: str | None
    agent_name: str | None
    proxy_url: str  # the proxy's root, for base_url
    # The calls' transition ids, in the order their answers came (every agent's, shared).
    transition_ids: list[str] = field(default_factory=list)
    # With on_error set, a block that raises posts that final reward (a sync or an async post).
    on_error: float | None = None
    post_sync: Callable[[float, str], object] | None = field(default=None, repr=False)
    post_async: Callable[[float, str], Awaitable[object]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("id", "task_id", "agent_name"):
            check_tag(name, getattr(self, name))

    @property
    def headers(self) -> dict[str, str]:
        return {h: getattr(self, k) for k, h in HEADERS.items() if getattr(self, k) is not None}

    @property
    def base_url(self) -> str:
        """The path form of the tags, for a client that takes only a base URL (ends in /v1)."""
        parts = [f"{key}/{getattr(self, k)}" for k, key in PATH_KEYS.items() if getattr(self, k)]
        return f"{self.proxy_url}/{'/'.join(parts)}/v1"

    def agent(self, name: str) -> Episode:
        """This episode as agent `name` calls it (multi-agent); enter it like the episode."""
        return replace(self, agent_name=name, on_error=None)

    def _enter(self) -> None:
        _entered.set((*_entered.get(), (self, _current.set(self))))

    def _exit(self) -> None:
        *outer, (innermost, token) = _entered.get()
        if innermost is not self:
            raise RuntimeError(f"episode {self.id} left while an episode inside it is still open")
        _entered.set(tuple(outer))
        _current.reset(token)

    def __enter__(self) -> Episode:
        if self.on_error is not None and self.post_sync is None:
            raise TypeError("this episode posts on_error asynchronously: use `async with`")
        self._enter()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exit()
        if error is not None and self.on_error is not None and self.post_sync is not None:
            try:
                self.post_sync(self.on_error, ON_ERROR_SOURCE)
            except Exception as e:  # the block's own error is the one to raise
                log.warning("episode %s: the on_error reward was not posted: %s", self.id, e)

    async def __aenter__(self) -> Episode:
        self._enter()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exit()
        if error is None or self.on_error is None:
            return
        try:
            if self.post_async is not None:
                await self.post_async(self.on_error, ON_ERROR_SOURCE)
            elif self.post_sync is not None:
                self.post_sync(self.on_error, ON_ERROR_SOURCE)
        except Exception as e:
            log.warning("episode %s: the on_error reward was not posted: %s", self.id, e)


# --- the hooks: any httpx (or openai's and anthropic's httpx2) client ------------------------


def _tag(request: Any) -> None:
    episode = _current.get()
    if episode is None:
        return
    for name, value in episode.headers.items():
        if name not in request.headers:  # a header the call sets itself wins
            request.headers[name] = value


def _note(response: Any) -> None:
    episode = _current.get()
    if episode is None or response.request.headers.get("x-episode-id") != episode.id:
        return
    ids = response.headers.get("x-transition-id")
    if ids:
        episode.transition_ids.extend(ids.split(","))


async def _atag(request: Any) -> None:
    _tag(request)


async def _anote(response: Any) -> None:
    _note(response)


C = TypeVar("C")


def tag_client(client: C) -> C:
    """Add the episode hooks to an httpx client (sync or async; openai's and anthropic's
    DefaultHttpxClient too) and return it."""
    is_async = hasattr(client, "aclose")
    hooks: dict[str, list[Any]] = dict(client.event_hooks)  # type: ignore[attr-defined]
    hooks["request"] = [*hooks.get("request", []), _atag if is_async else _tag]
    hooks["response"] = [*hooks.get("response", []), _anote if is_async else _note]
    client.event_hooks = hooks  # type: ignore[attr-defined]
    return client
