"""Server-sent events both ways: vLLM's stream read into events (`sse_events`), and the relay's
stream to the client (`RelayResponse`), closed however the client's connection ends.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.disconnect import cancelled_on_disconnect
from proxy.relay.http1 import Response as UpstreamResponse


class RelayResponse(Response):
    """A stream (SSE) whose relay is always closed when the response ends, however it ends.

    A client that disconnects ends the stream (proxy/disconnect.py). The relay may then be parked
    at a `yield` or not started at all, and its `finally` (close vLLM's request, record the
    transition as aborted) would run only when garbage-collected, or never: it is closed here,
    and `after` covers "never started".
    """

    media_type = "text/event-stream"

    def __init__(
        self, relay: AsyncGenerator[bytes], headers: dict[str, str], after: Callable[[], None]
    ) -> None:
        self.status_code = 200
        self.init_headers(headers)
        self._relay, self._after = relay, after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with cancelled_on_disconnect(receive):
                start = {"type": "http.response.start", "status": self.status_code}
                await send({**start, "headers": self.raw_headers})
                async for chunk in self._relay:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._relay.aclose()
            self._after()


async def sse_events(response: UpstreamResponse) -> AsyncIterator[list[tuple[bytes, bytes]]]:
    """(event name or b"", data) of the events of vLLM's SSE stream (events end with a blank
    line), a list per block read: those that arrived together. An event may be any length (vLLM's
    first chunk carries every prompt token id); each byte is scanned once, however the blocks
    arrive. Chat and completions send only `data:` lines; the Responses API names each event
    (`event: response.output_text.delta`).
    """
    buffer = bytearray()
    async for block in response.iter_any():
        start = max(0, len(buffer) - 1)  # a "\n\n" may straddle two blocks
        buffer += block
        events = []
        while (end := buffer.find(b"\n\n", start)) != -1:
            event, start = bytes(buffer[:end]), 0
            del buffer[: end + 2]
            name = b""
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    events.append((name, line[5:].lstrip(b" ")))
                elif line.startswith(b"event:"):
                    name = line[6:].strip()
        if events:
            yield events
