"""TCP keepalive on a connection to vLLM: how the relay tells a silent, busy vLLM (its kernel
still answers probes) from a vanished one (a partition, a dead host), within a bound.
"""

from __future__ import annotations

import socket

MAX_KEEPIDLE_S = 32_767  # Linux's MAX_TCP_KEEPIDLE and MAX_TCP_KEEPINTVL


def keep_probing(sock: socket.socket, dead_after_s: float) -> None:
    """Drop the connection once the peer has acknowledged nothing for `dead_after_s`.

    vLLM can be silent for minutes while it generates (a non-streamed answer, a long prefill),
    and silence is no sign of trouble: the peer's kernel still answers keepalive probes, however
    busy vLLM is. Packets that go unanswered are: the connection fails (ETIMEDOUT), the call
    goes to another replica if nothing reached the client yet, and a stream ends `failed`.
    Without this a partitioned replica held each call until the whole deadline (600 s).
    """
    # Linux refuses (EINVAL) a keepalive idle or interval above MAX_TCP_KEEPIDLE: clamped, so a
    # bound of a day or more still probes (proxy/config/relay.py bounds the setting at a day).
    idle = min(MAX_KEEPIDLE_S, max(1, int(dead_after_s / 3)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", idle),  # silent this long: start probing
        ("TCP_KEEPINTVL", max(1, idle // 2)),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", int(dead_after_s * 1000)),  # Linux: the bound, probes or data
    ):
        if hasattr(socket, name):  # (not every platform has each)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
