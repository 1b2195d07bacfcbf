"""`flywheel.client`: a small typed client for applications whose agents call through the
Flywheel proxy. It needs only httpx (never the proxy, SQLAlchemy or torch); the OpenAI and
Anthropic SDKs are imported only by `fw.openai()` / `fw.anthropic()`.

    from flywheel.client import Flywheel

    fw = Flywheel()  # FLYWHEEL_BASE_URL (default http://127.0.0.1:8000), FLYWHEEL_API_KEY
    llm = fw.openai()  # an openai.OpenAI whose calls carry the open episode's tags
    with fw.episode(task="t7", agent="solver") as ep:
        answer = llm.chat.completions.create(model="policy", messages=[...])
        fw.reward(1.0)  # ep's final reward: an idempotency key made once, kept across retries
    fw.demonstrate(messages, "the answer it should have given")  # a warm start, a correction

`AsyncFlywheel` is the same, awaited (`async with fw.episode(...)`).
"""

from flywheel.client.aio import AsyncFlywheel
from flywheel.client.config import Retry
from flywheel.client.episode import Episode, current, tag_client
from flywheel.client.errors import (
    AuthenticationError,
    EpisodeNotFound,
    FlywheelError,
    IdempotencyKeyReused,
    ProxyUnavailable,
    RequestRejected,
)
from flywheel.client.records import (
    Demonstration,
    DemonstrationResult,
    EpisodeView,
    Reward,
    RewardResult,
    RewardStatus,
    RewardView,
    TransitionView,
)
from flywheel.client.sync import Flywheel

__all__ = [
    "AsyncFlywheel",
    "AuthenticationError",
    "Demonstration",
    "DemonstrationResult",
    "Episode",
    "EpisodeNotFound",
    "EpisodeView",
    "Flywheel",
    "FlywheelError",
    "IdempotencyKeyReused",
    "ProxyUnavailable",
    "RequestRejected",
    "Retry",
    "Reward",
    "RewardResult",
    "RewardStatus",
    "RewardView",
    "TransitionView",
    "current",
    "tag_client",
]
