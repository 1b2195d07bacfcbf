"""The completion calls to vLLM: a small keep-alive HTTP/1.1 client, one pool per replica.

Every agent call passes through here, so it does only what those calls need, cheaply: a POST
written in one piece; the answer parsed by httptools (the parser uvicorn uses), with a
Content-Length or chunked body, read whole or as it arrives (with flow control for streams);
keep-alive connections reused newest-first and dropped before vLLM's own idle timeout; TLS for
https; one deadline for the whole exchange; TCP keepalives, so a replica cut off by the network
is found out in `dead_after_s`, not at the deadline. aiohttp's client cost ~175 µs of CPU per
call here, this one ~30 µs (docs/benchmarks.md). The rare calls (models, adapters, probes) stay
on aiohttp (core/vllm.py). At ~340 lines this file is over the usual size on purpose: it is one
protocol, and its parser callbacks, connection and pool only make sense read together.

    pool = Pool("http://vllm:8000", {"Content-Type": "application/json"})
    response = await pool.post("/v1/chat/completions", body, timeout_s=600)
    payload = await response.read()      # or: async for block in response.iter_any()
    response.release()                   # back to the pool; close() drops the connection
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from functools import cached_property
from urllib.parse import urlsplit

import httptools

from proxy.relay import keepalive

CONNECT_TIMEOUT_S = 10.0  # vLLM on the same network answers a TCP connect in milliseconds
IDLE_S = 4.0  # uvicorn (vLLM's server) closes keep-alive connections idle for 5 s
HIGH_WATER, LOW_WATER = 1 << 20, 1 << 18  # unread stream bytes: pause reading / resume
DEAD_AFTER_S = 30.0  # unanswered packets (a partition, a vanished host): the connection is dead


class UpstreamBroken(ConnectionError):
    """Could not connect, or the connection closed before the answer was complete."""


class Pool:
    """Keep-alive connections to one origin (a vLLM replica's base URL, path prefix allowed)."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        dead_after_s: float = DEAD_AFTER_S,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.base_url = base_url
        self._host, self._tls = url.hostname, url.scheme == "https"
        self._port = url.port or (443 if self._tls else 80)
        self._prefix = url.path.rstrip("/").encode()
        host = url.netloc.rpartition("@")[2]
        lines = [f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
        self._headers = "".join(line + "\r\n" for line in lines).encode("latin-1")
        self._connect_timeout_s = connect_timeout_s
        self._dead_after_s = dead_after_s
        self._idle: list[_Connection] = []  # newest last
        self._open: set[_Connection] = set()

    async def post(self, path: str, body: bytes, *, timeout_s: float) -> Response:
        """Send; return once the status and headers are in (the body may still be coming).

        Raises UpstreamBroken (nothing answered: safe to send elsewhere) or TimeoutError.
        """
        head = b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n" % (
            self._prefix + path.encode(),
            self._headers,
            len(body),
        )
        deadline = asyncio.get_running_loop().time() + timeout_s
        reused = self._take()
        if reused is not None:
            try:
                return await reused.exchange(self, head, body, deadline)
            except UpstreamBroken:
                if reused.got_bytes:
                    raise
                # vLLM closed the idle connection as we sent: it never saw the call
        connection = await self._connect()
        return await connection.exchange(self, head, body, deadline)

    def close(self) -> None:
        for connection in list(self._open):
            connection.close()
        self._idle.clear()

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            # got_bytes: vLLM sent something unasked while it was idle; not to be trusted
            fresh = now - connection.idle_since < IDLE_S
            if connection.usable and fresh and not connection.got_bytes:
                return connection
            connection.close()
        return None

    def _give_back(self, connection: _Connection) -> None:
        now = connection.idle_since = time.monotonic()
        self._idle.append(connection)
        # The oldest idle ones are never taken again (newest first, and too old once taken): a
        # burst's extra connections are closed here, not kept open until the server closes them.
        while now - self._idle[0].idle_since >= IDLE_S:
            self._idle.pop(0).close()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    _Connection, self._host, self._port, ssl=self._tls or None
                )
        except (OSError, TimeoutError) as e:
            raise UpstreamBroken(f"cannot connect to {self.base_url}: {e!r}") from e
        sock = connection.transport.get_extra_info("socket") if connection.transport else None
        if sock is not None:
            keepalive.keep_probing(sock, self._dead_after_s)
        self._open.add(connection)
        connection.on_close = self._open.discard
        return connection


class Response:
    """One answer; the connection is the caller's until `release()` or `close()`."""

    def __init__(self, pool: Pool, connection: _Connection) -> None:
        self._pool, self._connection = pool, connection
        self.status = connection.status
        self._raw_headers = connection.headers
        self._body: bytes | None = None
        self._done = False

    @cached_property
    def headers(self) -> dict[str, str]:
        """Lower-cased names (the hot path reads only the content type, and not on success)."""
        return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self._raw_headers}

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/octet-stream").split(";")[0].strip()

    async def read(self) -> bytes:
        """The whole body (kept: a second call returns it again)."""
        if self._body is None:
            c = self._connection
            await c.until(lambda: c.complete)
            self._body = b"".join(c.take_all())
        return self._body

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body in the blocks it arrives in."""
        c = self._connection
        while True:
            await c.until(lambda: bool(c.chunks) or c.complete)
            while c.chunks:
                yield c.take()
            if c.complete:
                return

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the answer was read to its end
        and vLLM keeps it alive; otherwise it is closed."""
        if self._done:
            return
        self._done = True
        if self._connection.reusable:
            self._connection.reset()
            self._pool._give_back(self._connection)
        else:
            self._connection.close()

    def close(self) -> None:
        """Drop the connection (vLLM aborts a generation whose connection closes). After
        `release()` it does nothing: the connection may be serving another call by then."""
        if self._done:
            return
        self._done = True
        self._connection.close()


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.on_close: Callable[[_Connection], None] | None = None
        self.reset()

    def reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = self.complete = self.got_bytes = self.keep_alive = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False

    @property
    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    @property
    def reusable(self) -> bool:
        return self.usable and self.complete and self.error is None and self.keep_alive

    async def exchange(self, pool: Pool, head: bytes, body: bytes, deadline: float) -> Response:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(deadline, self._expire)
        self.transport.writelines((head, body))
        try:
            await self.until(lambda: self.headers_done)
        except BaseException:
            self.close()
            raise
        return Response(pool, self)

    async def until(self, ready: Callable[[], bool]) -> None:
        """Wait for `ready()`; raise the connection's error if it comes first."""
        while not ready():
            if self.error is not None:
                raise self.error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def take(self) -> bytes:
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self._paused and self.buffered <= LOW_WATER and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def take_all(self) -> list[bytes]:
        chunks = list(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        return chunks

    def close(self) -> None:
        self._stop_timer()
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamBroken(f"malformed HTTP answer from vLLM: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        if not self.complete:
            reason = f": {exc!r}" if exc else ""
            self._fail(
                UpstreamBroken(f"vLLM closed the connection before answering in full{reason}")
            )
        if self.on_close is not None:
            self.on_close(self)

    # --- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the body ends
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._stop_timer()
        self._wake()

    # --- internals -----------------------------------------------------------------------------

    def _expire(self) -> None:
        self._timer = None
        self._fail(TimeoutError("vLLM did not answer within the upstream timeout"))
        self.close()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
