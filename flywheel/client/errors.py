"""What went wrong, as exceptions whose message says what to do. The proxy's errors are
OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`); each keeps status and code."""

from __future__ import annotations

from typing import Any


class FlywheelError(Exception):
    """Any error from the proxy or on the way to it."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


class AuthenticationError(FlywheelError):
    """401 (no key, or one the proxy does not know) or 403 (a key without the scope)."""


class EpisodeNotFound(FlywheelError):
    """404: no such episode, or no such transition / tool call in it (for this key's tenant)."""


class IdempotencyKeyReused(FlywheelError):
    """409: this idempotency key was used for another value in the same episode."""


class RequestRejected(FlywheelError):
    """Any other refusal: a bad reward (400), a step reward that would change a trained return
    or a tool call id that names two calls (409), ..."""


class ProxyUnavailable(FlywheelError):
    """No answer but "busy" (429, 502, 503, 504) or none at all, after every retry."""


def from_response(status: int, body: Any, url: str, *, episode_id: str | None) -> FlywheelError:
    """The exception for an error answer from `url`."""
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    message = str(error.get("message") or body)[:500]
    code = error.get("code")
    said = f"{url} answered {status}: {message}"
    if status == 401:
        return AuthenticationError(
            f"{said}. Set FLYWHEEL_API_KEY (or pass api_key=) to a key the proxy knows: one of "
            "its FLYWHEEL_API_KEYS, or one made with `flywheel keys create`.",
            status=status,
            code=code,
        )
    if status == 403:
        return AuthenticationError(
            f"{said}. Use a key with that scope (`flywheel keys create --scopes "
            "infer,reward,read`).",
            status=status,
            code=code,
        )
    if status == 404 and code in ("episode_not_found", "transition_not_found"):
        return EpisodeNotFound(
            f"{said}. Check the id: episode {episode_id!r} has no such record for this API key "
            "(a tenant sees only its own episodes; a step names a transition of that episode).",
            status=status,
            code=code,
        )
    if status == 409 and code == "idempotency_key_reused":
        return IdempotencyKeyReused(
            f"{said}. That key already stands for another value in episode {episode_id!r}: "
            "a different reward needs its own idempotency_key (or leave it out, to get a new one).",
            status=status,
            code=code,
        )
    return RequestRejected(said, status=status, code=code)


def unreachable(url: str, attempts: int, last: str) -> ProxyUnavailable:
    return ProxyUnavailable(
        f"no answer from the Flywheel proxy at {url} after {attempts} attempt(s) ({last}). "
        "Is it running there? Set FLYWHEEL_BASE_URL (or pass base_url=) to its address.",
        code="unreachable",
    )


def busy(url: str, attempts: int, status: int, body: str) -> ProxyUnavailable:
    return ProxyUnavailable(
        f"{url} still answered {status} after {attempts} attempt(s): {body[:300]}. "
        "It is overloaded or cannot store anything now (Postgres and its journal both down?); "
        "retry later with the same idempotency keys (Retry(attempts=...) tries longer).",
        status=status,
        code="unavailable",
    )
