"""The proxies alive, by heartbeat (`proxy_replica`): how many share each tenant's quota."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession


async def beat(replica: str, *, session: AsyncSession, alive_s: float) -> int:
    """This replica's heartbeat; the rows of replicas silent for ten times `alive_s` deleted
    (crashed, never to leave); how many beat within `alive_s` (this one included)."""
    await session.execute(
        text(
            "INSERT INTO proxy_replica (id) VALUES (:id) "
            "ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()"
        ),
        {"id": replica},
    )
    await session.execute(
        text("DELETE FROM proxy_replica WHERE heartbeat_at < now() - make_interval(secs => :s)"),
        {"s": alive_s * 10},
    )
    alive = await session.scalar(
        text(
            "SELECT count(*) FROM proxy_replica "
            "WHERE heartbeat_at >= now() - make_interval(secs => :s)"
        ),
        {"s": alive_s},
    )
    return max(1, int(alive or 0))


async def leave(replica: str, *, session: AsyncSession) -> None:
    """A replica stopping: its share goes to the others at their next heartbeat."""
    await session.execute(text("DELETE FROM proxy_replica WHERE id = :id"), {"id": replica})
