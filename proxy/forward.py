"""Forwarding one completion call to vLLM and recording what came back.

The request goes upstream as the client wrote it, except: the model alias is resolved, and vLLM
is always asked for `return_token_ids` and sampled-token `logprobs`. On the way back those are
removed again where the client did not ask for them, so the client sees what vLLM would have sent
it. Each choice becomes one transition, handed to the background writer (never awaited here).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy import metrics, wire
from proxy.alias import PolicyAlias
from proxy.errors import ApiError, error_response
from proxy.http1 import Response as UpstreamResponse
from proxy.http1 import UpstreamBroken
from proxy.recorder import Recorder
from proxy.tags import Tags
from proxy.upstream import Replica, Upstream

log = logging.getLogger(__name__)

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MAX_CHOICES = 256  # n x prompts per call; more is almost certainly a client bug
# What a completion call to vLLM can raise (alias.restore handles its own aiohttp errors).
UPSTREAM_ERRORS = (UpstreamBroken, TimeoutError)
# labels() takes a lock and a lookup per call: the children, once
_UPSTREAM_LATENCY = {route: metrics.upstream_latency.labels(route) for route in PATHS}
_PROXY_OVERHEAD = {route: metrics.proxy_overhead.labels(route) for route in PATHS}


@dataclass
class Call:
    route: str
    tags: Tags
    body: dict[str, Any]
    model_used: str
    policy_version: int | None
    transition_ids: list[str]
    request_id: str
    requested_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)
    upstream_s: float = 0.0
    recorded: bool = False
    replica: Replica | None = None  # holds an outstanding slot there while set
    scrub: bool = False  # the request holds a U+0000: make the records storable

    @property
    def wants_logprobs(self) -> bool:
        value = self.body.get("logprobs")
        return value is not None and value is not False

    @property
    def wants_token_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    def headers(self) -> dict[str, str]:
        version = "none" if self.policy_version is None else str(self.policy_version)
        return {
            "X-Episode-Id": self.tags.episode_id,
            "X-Transition-Id": ",".join(self.transition_ids),
            "X-Policy-Version": version,
        }


class Forwarder:
    def __init__(self, upstream: Upstream, alias: PolicyAlias, recorder: Recorder) -> None:
        self._upstream = upstream
        self._alias = alias
        self._recorder = recorder

    async def handle(
        self, route: str, body: dict[str, Any], tags: Tags, *, scrub: bool = False
    ) -> Response:
        """Forward one call. `scrub`: the body holds a U+0000, to be made storable when recorded."""
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "`model` is required and must be a string", param="model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise ApiError(400, "`stream` must be a boolean", param="stream")
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ApiError(400, "`n` must be a positive integer", param="n")
        choices = n * wire.prompt_count(body) if route == "completions" else n
        if choices > MAX_CHOICES:
            raise ApiError(400, f"n x prompts = {choices} exceeds {MAX_CHOICES}", param="n")

        model_used, version = await self._alias.resolve(model)
        *transition_ids, request_id = random_uuids(choices + 1)
        call = Call(
            route=route,
            tags=tags,
            body=body,
            model_used=model_used,
            policy_version=version,
            transition_ids=transition_ids,
            request_id=request_id,
            scrub=scrub,
        )
        upstream_body = {**body, "model": model_used, "return_token_ids": True}
        if route == "chat":
            upstream_body["logprobs"] = True
        elif not call.wants_logprobs:
            upstream_body["logprobs"] = 0  # completions: 0 = the sampled token's logprob only

        sent = time.perf_counter()
        try:
            response = await self._send(call, orjson.dumps(upstream_body), read=not stream)
        except UPSTREAM_ERRORS as e:
            return self._failed_to_connect(call, e, sent)

        if stream and response.status == 200:
            # The stream owns the replica's slot from here on: RelayResponse frees it at the end.
            return RelayResponse(
                self._relay(call, response, sent),
                call.headers(),
                after=partial(self._end_stream, call, response),
            )
        try:
            payload = await response.read()  # already read by _send, except for a failed stream
        except UPSTREAM_ERRORS as e:
            response.close()
            return self._failed_to_connect(call, e, sent)
        finally:
            response.release()
            self._free(call)
        call.upstream_s = time.perf_counter() - sent
        if response.status != 200:
            self._record_failure(call, response.status, payload)
            return Response(
                payload,
                status_code=response.status,
                media_type=response.content_type,
                headers=call.headers(),
            )
        data = orjson.loads(payload)
        collected = wire.collect(call.route, data)
        if not (call.wants_logprobs and call.wants_token_ids):
            wire.strip(data, token_ids=call.wants_token_ids, logprobs=call.wants_logprobs)
            payload = orjson.dumps(data)
        self._record(call, collected, status="ok", http_status=200)
        return Response(payload, media_type="application/json", headers=call.headers())

    async def _send(self, call: Call, body: bytes, *, read: bool) -> UpstreamResponse:
        """Send to the episode's replica; if it cannot be reached, eject it and try the next.

        Sending again is safe: nothing has reached the client yet, and a call vLLM did not answer
        changed nothing. With `read`, a connection lost while reading the answer counts too (a
        replica killed mid-generation). On return `call.replica` holds the answering replica's slot.
        """
        episode = None if call.tags.generated else call.tags.episode_id
        tried: tuple[Replica, ...] = ()
        while (replica := self._upstream.pick(episode, exclude=tried)) is not None:
            if tried:
                metrics.upstream_retries.inc()
            tried += (replica,)
            call.replica = replica
            response = None
            try:
                response = await self._post(call, replica, body)
                if read:
                    await response.read()  # kept for the caller
                return response
            except UpstreamBroken as e:
                self._free(call)
                self._upstream.failed(replica, repr(e))
                if len(tried) == len(self._upstream.replicas):
                    raise
            except BaseException:  # a timeout, or the client left: vLLM may stop generating
                if response is not None:
                    response.close()
                self._free(call)
                raise
        raise UpstreamBroken("no vLLM replica to send to")

    async def _post(self, call: Call, replica: Replica, body: bytes) -> UpstreamResponse:
        response = await self._upstream.post(replica, PATHS[call.route], body)
        if response.status == 404 and call.policy_version:
            # A restarted vLLM has none of our adapters: load this one again and retry once.
            await response.read()  # kept: the 404 can still be passed through
            response.release()
            if await self._alias.restore(replica, call.model_used):
                response = await self._upstream.post(replica, PATHS[call.route], body)
        return response

    def _free(self, call: Call) -> None:
        """Give back the replica slot of this call (once, however the call ends)."""
        if call.replica is not None:
            self._upstream.release(call.replica)
            call.replica = None

    async def _relay(
        self, call: Call, response: UpstreamResponse, sent: float
    ) -> AsyncGenerator[bytes]:
        """Pass SSE events through as they come, collecting each choice's tokens on the way."""
        collected: dict[int, wire.Choice] = {}
        status, error = "aborted", None
        try:
            async for data_bytes in sse_data(response):
                if data_bytes == b"[DONE]":
                    status = "ok" if error is None else "failed"
                    yield b"data: [DONE]\n\n"
                    continue
                chunk = orjson.loads(data_bytes)
                if "error" in chunk:
                    error = chunk
                else:
                    wire.collect_chunk(call.route, chunk, collected)
                    if not (call.wants_logprobs and call.wants_token_ids):
                        wire.strip(
                            chunk, token_ids=call.wants_token_ids, logprobs=call.wants_logprobs
                        )
                        data_bytes = orjson.dumps(chunk)
                yield b"data: " + data_bytes + b"\n\n"
        except UPSTREAM_ERRORS as e:
            status, error = "failed", {"error": {"message": f"upstream stream broke: {e}"}}
            log.warning("upstream stream broke: %s", e)
        finally:
            # Reached on [DONE], on an upstream error, and when the client disconnects (the
            # response task is cancelled): closing the connection makes vLLM abort the request.
            if status == "ok":
                response.release()
            else:
                response.close()
            call.upstream_s = time.perf_counter() - sent
            if error is not None:
                self._record_failure(call, 200, orjson.dumps(error), partial=collected)
            else:
                self._record(call, collected, status=status, http_status=200)

    def _end_stream(self, call: Call, response: UpstreamResponse) -> None:
        self._free(call)
        if not call.recorded:  # the client left before the relay's first step
            response.close()
            self._record(call, {}, status="aborted", http_status=200)

    # --- recording ------------------------------------------------------------------------

    def _record(
        self, call: Call, collected: dict[int, wire.Choice], *, status: str, http_status: int
    ) -> None:
        records = []
        for index, transition_id in enumerate(call.transition_ids):
            choice = collected.get(index, wire.Choice())
            records.append(
                _record_base(call, index, transition_id, status, http_status)
                | {
                    "prompt_token_ids": choice.prompt_token_ids,
                    "completion_token_ids": choice.token_ids,
                    "logprobs": choice.logprobs,
                    "text": "".join(choice.text),
                    "tool_calls": [choice.tool_calls[i] for i in sorted(choice.tool_calls)] or None,
                    "finish_reason": choice.finish_reason,
                    "prompt_tokens": len(choice.prompt_token_ids or ()),
                    "completion_tokens": len(choice.token_ids),
                }
            )
        self._submit(call, records)

    def _record_failure(
        self,
        call: Call,
        http_status: int,
        payload: bytes,
        partial: dict[int, wire.Choice] | None = None,
    ) -> None:
        try:
            error = orjson.loads(payload)
        except orjson.JSONDecodeError:
            error = {"raw": payload[:10_000].decode(errors="replace")}
        record = _record_base(call, 0, call.transition_ids[0], "failed", http_status)
        record["error"] = error if isinstance(error, dict) else {"raw": error}
        if partial:
            record["text"] = "".join(partial.get(0, wire.Choice()).text)
        self._submit(call, [record])

    def _failed_to_connect(self, call: Call, e: Exception, sent: float) -> Response:
        call.upstream_s = time.perf_counter() - sent
        timeout = isinstance(e, TimeoutError)
        status = 504 if timeout else 502
        message = f"upstream vLLM {'timed out' if timeout else 'unreachable'}: {e!r}"
        self._record_failure(call, status, orjson.dumps({"error": {"message": message}}))
        return error_response(
            status,
            message,
            type="upstream_error",
            code="upstream_timeout" if timeout else "upstream_unreachable",
            headers=call.headers(),
        )

    def _submit(self, call: Call, records: list[dict[str, Any]]) -> None:
        call.recorded = True
        if call.scrub or any(wire.has_nul(r) for r in records):
            records = wire.pg_safe(records)
        self._recorder.submit(records)
        elapsed = time.perf_counter() - call.started
        _UPSTREAM_LATENCY[call.route].observe(call.upstream_s)
        _PROXY_OVERHEAD[call.route].observe(max(0.0, elapsed - call.upstream_s))


class RelayResponse(StreamingResponse):
    """A stream whose relay is always closed when the response ends, however it ends.

    A client that disconnects cancels the send loop; the relay may then be parked at a `yield`
    or not started at all, and its `finally` (close vLLM's request, record the transition as
    aborted) would run only when garbage-collected, or never. `after` covers "never started".
    """

    def __init__(
        self, relay: AsyncGenerator[bytes], headers: dict[str, str], after: Callable[[], None]
    ) -> None:
        super().__init__(relay, media_type="text/event-stream", headers=headers)
        self._relay, self._after = relay, after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._relay.aclose()
            self._after()


async def sse_data(response: UpstreamResponse) -> AsyncIterator[bytes]:
    """The `data:` payloads of vLLM's SSE stream (events end with a blank line), however long
    (vLLM's first chunk carries every prompt token id). Each byte is scanned once, however the
    blocks arrive.
    """
    buffer = bytearray()
    async for block in response.iter_any():
        start = max(0, len(buffer) - 1)  # a "\n\n" may straddle two blocks
        buffer += block
        while (end := buffer.find(b"\n\n", start)) != -1:
            event, start = bytes(buffer[:end]), 0
            del buffer[: end + 2]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].lstrip(b" ")


def random_uuids(n: int) -> list[str]:
    """n version-4 UUID strings from one read of the OS's randomness (uuid4() and str() per id
    were ~4% of the proxy's CPU at 64 clients)."""
    raw = bytearray(os.urandom(16 * n))
    out = []
    for i in range(0, 16 * n, 16):
        raw[i + 6] = (raw[i + 6] & 0x0F) | 0x40  # version 4
        raw[i + 8] = (raw[i + 8] & 0x3F) | 0x80  # RFC 4122 variant
        h = raw[i : i + 16].hex()
        out.append(f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    return out


def _record_base(
    call: Call, index: int, transition_id: str, status: str, http_status: int
) -> dict[str, Any]:
    body = call.body
    if call.route == "chat":
        messages = body.get("messages")
        prompt_messages = messages if isinstance(messages, list) else []
        params = {k: v for k, v in body.items() if k != "messages"}
    else:
        prompts = wire.prompts(body.get("prompt"))
        n = len(call.transition_ids) // max(1, len(prompts))
        prompt_messages = [{"prompt": prompts[index // max(1, n)]}] if prompts else []
        params = {k: v for k, v in body.items() if k != "prompt"}
    return {
        "id": transition_id,
        "episode_id": call.tags.episode_id,
        "request_id": call.request_id,
        "choice_index": index,
        "task_id": call.tags.task_id,
        "agent_name": call.tags.agent_name,
        "requested_at": call.requested_at,
        "route": call.route,
        "status": status,
        "http_status": http_status,
        "model_requested": body.get("model"),
        "model_used": call.model_used,
        "policy_version": call.policy_version,
        "messages": prompt_messages,
        "params": params,
        "latency_ms": call.upstream_s * 1000.0,
    }
