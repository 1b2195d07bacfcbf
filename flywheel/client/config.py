"""Where the proxy is, which key to send, and how long to keep trying: read once, when a client is
made, from its arguments or else the environment.

- the base URL: `base_url=`, else FLYWHEEL_BASE_URL, else the proxy's default address
  (http://127.0.0.1:8000); with or without the trailing `/v1`. OPENAI_BASE_URL is deliberately
  not read: it often names OpenAI itself, and rewards posted there would be lost quietly.
- the key: `api_key=`, else FLYWHEEL_API_KEY, else none (a proxy on loopback needs none).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# What a retry may cure: the proxy (or a balancer in front of it) busy or restarting. A 202
# "journaled" is not among them: it is a success.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
# A reward waits up to 10 s in the proxy for the transitions it names (STORED_WAIT_S), then
# answers: a read timeout well beyond that means the proxy is stuck, not slow.
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Retry:
    """Bounded retries with exponential backoff (full jitter) for 429/502/503/504, connection
    errors and timeouts. `attempts` counts the first try: 1 turns retrying off."""

    attempts: int = 6
    backoff_s: float = 0.25  # before the second try; doubled each time
    backoff_max_s: float = 8.0  # the longest wait, also the cap on a Retry-After

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"Retry(attempts={self.attempts}): at least 1 (the first try)")
        if self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("Retry: backoff_s and backoff_max_s are seconds, at least 0")

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait after failed try number `attempt` (1-based)."""
        cap = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        if retry_after is not None:
            try:
                return min(self.backoff_max_s, max(0.0, float(retry_after)))
            except ValueError:  # an HTTP date: not worth parsing here
                pass
        return random.uniform(cap / 2, cap)


@dataclass(frozen=True)
class Config:
    base_url: str  # the proxy's root, without /v1
    api_key: str | None

    @classmethod
    def resolve(cls, base_url: str | None, api_key: str | None) -> Config:
        url = base_url or os.environ.get("FLYWHEEL_BASE_URL") or DEFAULT_BASE_URL
        url = url.rstrip("/").removesuffix("/v1")
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"base URL {url!r}: give the proxy's http(s) URL, e.g. {DEFAULT_BASE_URL} "
                "(argument base_url= or FLYWHEEL_BASE_URL)"
            )
        key = api_key if api_key is not None else os.environ.get("FLYWHEEL_API_KEY") or None
        return cls(url, key)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
