"""`cancelled_on_disconnect`: a streamed response's sending cut short when its client leaves.

A client that disconnects ends the stream: a watcher task waits for uvicorn's `http.disconnect`
and cancels the sending task, whose body (parked at a send, or at the next chunk) then stops at
once; that one cancellation ends the block quietly, any other goes on up. Starlette's
StreamingResponse does the same with an anyio task group per response, which cost ~0.4 ms of CPU
per streamed call here. The relay's stream (relay/sse.py) and the export (routes/export.py) use
it; each closes what it holds in its own `finally` after the block.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.types import Receive


@contextlib.asynccontextmanager
async def cancelled_on_disconnect(receive: Receive) -> AsyncIterator[None]:
    sending = asyncio.current_task()
    assert sending is not None
    left = False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        sending.cancel()  # lands at the await the sender is parked on, inside the block

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not left or sending.uncancel() > 0:  # cancelled by someone else too
            raise
    finally:
        watcher.cancel()
