"""Forwarding one completion call to vLLM and recording what came back.

The request goes upstream as the client wrote it, except: the model alias is resolved, and vLLM
is always asked for token ids and sampled-token logprobs (`return_token_ids` and `logprobs` on
chat and completions; `enable_response_messages` and output logprobs on the Responses API, see
responses.py). On the way back those are removed again where the client did not ask for them, so
the client sees what vLLM would have sent it. Each choice becomes one transition, handed to the
background writer (never awaited here), or first to the scorer when vLLM left its logprobs out.

A model name in FLYWHEEL_ROUTES goes to its provider through litellm instead
(proxy/relay/providers.py), recorded the same way but for token ids, logprobs and a lineage, which
it has none of.

Durable mode (FLYWHEEL_DURABLE): a successful answer is released only once its transitions are
committed or fsync'd to the journal: a non-streaming body after that, a stream's terminal event
(`[DONE]`, or the Responses API's `response.completed`) held until then. After `durable_wait_s`
(both Postgres and the journal failing) it is released all the same, and counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import partial
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from core.record import TransitionRecord
from proxy import metrics
from proxy.config import ProviderModel
from proxy.errors import ApiError, error_response
from proxy.record.air import ToolCheck
from proxy.record.recorder import Recorder
from proxy.relay import responses, wire
from proxy.relay.alias import PolicyAlias
from proxy.relay.call import Call, failure, random_uuids, transitions
from proxy.relay.http1 import Response as UpstreamResponse
from proxy.relay.http1 import UpstreamBroken
from proxy.relay.providers import ProviderFailed, Providers
from proxy.relay.scoring import Scorer, needs_scoring
from proxy.relay.tags import Tags
from proxy.relay.upstream import Replica, Upstream

log = logging.getLogger(__name__)

MAX_CHOICES = 256  # n x prompts per call; more is almost certainly a client bug
# What a completion call to vLLM can raise (alias.restore handles its own errors).
UPSTREAM_ERRORS = (UpstreamBroken, TimeoutError)
# labels() takes a lock and a lookup per call: the children, once
_UPSTREAM_LATENCY = {e.name: metrics.upstream_latency.labels(e.name) for e in wire.ENDPOINTS}
_PROXY_OVERHEAD = {e.name: metrics.proxy_overhead.labels(e.name) for e in wire.ENDPOINTS}


class Forwarder:
    def __init__(
        self,
        upstream: Upstream,
        alias: PolicyAlias,
        recorder: Recorder,
        scorer: Scorer,
        tool_check: ToolCheck | None = None,
        durable_wait_s: float | None = None,
        providers: Providers | None = None,
    ) -> None:
        self._upstream = upstream
        self._alias = alias
        self._recorder = recorder
        self._scorer = scorer
        self._tool_check = tool_check  # AIR (proxy/record/air.py); None: off
        self._durable_wait_s = durable_wait_s  # None: durable mode off
        self._providers = providers  # FLYWHEEL_ROUTES; None: none

    async def handle(
        self, endpoint: wire.Endpoint, body: dict[str, Any], tags: Tags, *, scrub: bool = False
    ) -> Response:
        """Forward one call. `scrub`: the body holds a U+0000, to be made storable when recorded."""
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "`model` is required and must be a string", param="model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise ApiError(400, "`stream` must be a boolean", param="stream")
        provider_model = self._providers.get(model) if self._providers is not None else None
        if provider_model is not None:
            if endpoint is not wire.CHAT:
                raise ApiError(
                    400,
                    f"model {model!r} is served by a provider (FLYWHEEL_ROUTES), "
                    "through /v1/chat/completions only",
                    param="model",
                )
            return await self._forward_to_provider(
                provider_model, body, tags, stream=bool(stream), scrub=scrub
            )
        choices = 1
        if endpoint is wire.RESPONSES:
            responses.check(body)  # one model call, one transition
        else:
            choices = _choices(endpoint, body)

        resolved = await self._alias.resolve(model, tags.agent_name, tags.episode_id)
        *transition_ids, request_id = random_uuids(choices + 1)
        call = Call(
            endpoint=endpoint,
            tags=tags,
            body=body,
            model_used=resolved.model,
            policy_version=resolved.version,
            lineage=resolved.lineage,
            transition_ids=transition_ids,
            request_id=request_id,
            scrub=scrub,
        )
        upstream_body = _upstream_body(call, resolved.model)

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
            if call.endpoint is wire.RESPONSES:
                payload = responses.unknown_previous(call.body, response.status, payload) or payload
            self._submit(call, failure(call, response.status, payload))
            return Response(
                payload,
                status_code=response.status,
                media_type=response.content_type,
                headers=call.headers(),
            )
        data = orjson.loads(payload)
        collected = _collect(call.endpoint, data)
        if call.endpoint is wire.RESPONSES:
            call.response_id = data.get("id")
        if not (call.wants_logprobs and call.wants_token_ids):
            _strip(call, data)
            payload = orjson.dumps(data)
        self._submit(call, transitions(call, collected, "ok"))
        await self._safe(call)
        return Response(payload, media_type="application/json", headers=call.headers())

    async def _send(self, call: Call, body: bytes, *, read: bool) -> UpstreamResponse:
        """Send to the episode's replica; if it cannot be reached, eject it and try the next.

        Sending again is safe: nothing has reached the client yet, and a call vLLM did not answer
        changed nothing. With `read`, a connection lost while reading the answer counts too (a
        replica killed mid-generation). On return `call.replica` holds the answering replica's slot.
        """
        episode = None if call.tags.generated else call.tags.episode_id
        tried: tuple[Replica, ...] = ()
        previous = call.body.get("previous_response_id")
        previous = previous if isinstance(previous, str) else None
        pick = partial(self._upstream.pick, previous_response=previous, model=call.model_used)
        while replica := pick(episode, tried):
            if tried:
                metrics.upstream_retries.inc()
            tried += (replica,)
            call.replica = replica
            response = None
            try:
                response = await self._post(call, replica, body)
                if read:
                    await response.read()  # kept for the caller
                call.served_by = replica.base_url
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
        response = await self._upstream.post(replica, call.endpoint.path, body)
        if response.status == 404 and call.policy_version:
            # A restarted vLLM has none of our adapters: load this one again and retry once.
            await response.read()  # kept: the 404 can still be passed through
            response.release()
            if await self._alias.restore(replica, call.model_used):
                response = await self._upstream.post(replica, call.endpoint.path, body)
        return response

    def _free(self, call: Call) -> None:
        """Give back the replica slot of this call (once, however the call ends)."""
        if call.replica is not None:
            self._upstream.release(call.replica)
            call.replica = None

    async def _relay(
        self, call: Call, response: UpstreamResponse, sent: float
    ) -> AsyncGenerator[bytes]:
        """Pass SSE events through as they come, collecting each choice's tokens on the way.
        The events that arrived together leave together: one write to the client per block
        read from vLLM, not one per event (a socket write each, the relay's largest cost)."""
        collected: dict[int, wire.Choice] = {}
        status, error = "aborted", None
        detailed = call.wants_logprobs and call.wants_token_ids
        held = b""  # durable mode: the terminal event, sent once the transitions are safe
        try:
            async for events in sse_events(response):
                out = []
                for name, data_bytes in events:
                    if data_bytes == b"[DONE]":  # chat and completions
                        status = "ok" if error is None else "failed"
                        if self._durable_wait_s is None:
                            out.append(b"data: [DONE]\n\n")
                        else:
                            held = b"data: [DONE]\n\n"
                        continue
                    chunk = orjson.loads(data_bytes)
                    if call.endpoint is wire.RESPONSES:
                        ended = responses.read_event(chunk, collected.setdefault(0, wire.Choice()))
                        if ended is not None:
                            status = ended
                            call.response_id = (chunk.get("response") or {}).get("id")
                            if ended == "failed":
                                error = responses.error_of(chunk)
                    elif "error" in chunk:
                        error = chunk
                    else:
                        wire.collect_chunk(call.endpoint, chunk, collected)
                    if not detailed and error is None:
                        _strip(call, chunk)
                        data_bytes = orjson.dumps(chunk)
                    head = b"event: " + name + b"\ndata: " if name else b"data: "
                    if self._durable_wait_s is not None and status == "ok" and not held:
                        held = head + data_bytes + b"\n\n"  # the Responses API's response.completed
                        continue
                    out.append(head + data_bytes + b"\n\n")
                if out:
                    yield b"".join(out)
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
                self._submit(call, failure(call, 200, orjson.dumps(error), partial=collected))
            else:
                self._submit(call, transitions(call, collected, status))
        if held:
            await self._safe(call)
            yield held

    def _end_stream(self, call: Call, response: UpstreamResponse) -> None:
        self._free(call)
        if not call.recorded:  # the client left before the relay's first step
            response.close()
            self._submit(call, transitions(call, {}, "aborted"))

    # --- provider models (FLYWHEEL_ROUTES) ------------------------------------------------

    async def _forward_to_provider(
        self,
        provider_model: ProviderModel,
        body: dict[str, Any],
        tags: Tags,
        *,
        stream: bool,
        scrub: bool,
    ) -> Response:
        assert self._providers is not None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:  # (vLLM would say so; litellm crashes)
            raise ApiError(400, "`messages` must be a non-empty list", param="messages")
        *transition_ids, request_id = random_uuids(_choices(wire.CHAT, body) + 1)
        call = Call(
            endpoint=wire.CHAT,
            tags=tags,
            body=body,
            model_used=provider_model.model,
            policy_version=None,
            lineage=None,  # not a policy's: never trained
            transition_ids=transition_ids,
            request_id=request_id,
            scrub=scrub,
        )
        sent = time.perf_counter()
        try:
            if stream:
                chunks = await self._providers.stream(provider_model, body)
            else:
                data = await self._providers.complete(provider_model, body)
        except ProviderFailed as e:
            call.upstream_s = time.perf_counter() - sent
            self._submit(
                call, self._provided(provider_model, failure(call, e.status, orjson.dumps(e.body)))
            )
            return Response(
                orjson.dumps(e.body),
                status_code=e.status,
                media_type="application/json",
                headers=call.headers(),
            )
        if stream:
            return RelayResponse(
                self._relay_from_provider(call, provider_model, chunks, sent),
                call.headers(),
                after=partial(self._end_provider_stream, call, provider_model),
            )
        call.upstream_s = time.perf_counter() - sent
        records = transitions(call, wire.collect(wire.CHAT, data), "ok")
        self._submit(call, self._provided(provider_model, records, data.get("usage")))
        await self._safe(call)
        return Response(orjson.dumps(data), media_type="application/json", headers=call.headers())

    async def _relay_from_provider(
        self,
        call: Call,
        provider_model: ProviderModel,
        chunks: AsyncGenerator[dict[str, Any]],
        sent: float,
    ) -> AsyncGenerator[bytes]:
        """The provider's chunks as SSE events, collected on the way; the usage chunk the
        proxy asked for is passed on only if the client asked for it too."""
        collected: dict[int, wire.Choice] = {}
        status, error, usage = "aborted", None, None
        options = call.body.get("stream_options")
        wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        try:
            async for chunk in chunks:
                wire.collect_chunk(wire.CHAT, chunk, collected)
                usage = chunk.get("usage") or usage
                if not wants_usage and "usage" in chunk:
                    del chunk["usage"]
                    said = chunk.get("choices") or ()  # ([] or an empty delta, by provider)
                    if not any(c.get("delta") or c.get("finish_reason") for c in said):
                        continue  # the usage chunk, which the client did not ask for
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            status = "ok"
        except ProviderFailed as e:  # mid-stream: an error event, as OpenAI sends one
            status, error = "failed", e.body
            yield b"data: " + orjson.dumps(e.body) + b"\n\n"
        finally:
            await chunks.aclose()  # a client that left stops the provider's generation
            call.upstream_s = time.perf_counter() - sent
            if error is not None:
                records = failure(call, 200, orjson.dumps(error), partial=collected)
            else:
                records = transitions(call, collected, status)
            self._submit(call, self._provided(provider_model, records, usage))
        if status == "ok":
            await self._safe(call)
            yield b"data: [DONE]\n\n"

    def _end_provider_stream(self, call: Call, provider_model: ProviderModel) -> None:
        if not call.recorded:  # the client left before the relay's first step
            self._submit(call, self._provided(provider_model, transitions(call, {}, "aborted")))

    def _provided(
        self,
        provider_model: ProviderModel,
        records: list[TransitionRecord],
        usage: dict[str, Any] | None = None,
    ) -> list[TransitionRecord]:
        """Mark a provider's call's records: its provider, the provider's token counts (the n
        choices share the prompt; their completions are counted apart only when n is 1), and
        the call's price on its first choice."""
        assert self._providers is not None
        prompt = usage.get("prompt_tokens") if usage else None
        completion = usage.get("completion_tokens") if usage and len(records) == 1 else None
        for r in records:
            r.provider = provider_model.provider
            r.prompt_tokens, r.completion_tokens = prompt, completion
            r.completion_token_ids = None  # a provider's token ids are not ours to train on
            r.logprobs = r.logprobs or None  # kept where the client asked the provider for them
        cost = self._providers.cost(provider_model, usage)
        records[0].cost_usd = cost
        name = records[0].model_requested or ""  # a FLYWHEEL_ROUTES name: a bounded label
        metrics.provider_calls.labels(name, records[0].status).inc()
        if cost:
            metrics.provider_cost.labels(name).inc(cost)
        return records

    # --- recording ------------------------------------------------------------------------

    def _failed_to_connect(self, call: Call, e: Exception, sent: float) -> Response:
        call.upstream_s = time.perf_counter() - sent
        timeout = isinstance(e, TimeoutError)
        status = 504 if timeout else 502
        message = f"upstream vLLM {'timed out' if timeout else 'unreachable'}"
        detail = {"error": {"message": f"{message}: {e!r}"}}  # recorded; the client gets no URL
        self._submit(call, failure(call, status, orjson.dumps(detail)))
        return error_response(
            status,
            message,
            type="upstream_error",
            code="upstream_timeout" if timeout else "upstream_unreachable",
            headers=call.headers(),
        )

    async def _safe(self, call: Call) -> None:
        """Durable mode: wait until the call's transitions are committed or journaled."""
        if not call.watched:
            return
        _, waiting = await asyncio.wait(call.watched, timeout=self._durable_wait_s)
        if waiting:
            log.warning(
                "released a response before its transitions were safe (%d waiting): "
                "Postgres and the journal both fail",
                len(waiting),
            )
            metrics.durable_timeouts.inc()

    def _submit(self, call: Call, records: list[TransitionRecord]) -> None:
        call.recorded = True
        if self._durable_wait_s is not None and records[0].status == "ok":
            call.watched = self._recorder.watch([r.id for r in records])
        if call.scrub or any(wire.has_nul(r) for r in records):
            records = [wire.pg_safe_record(r) for r in records]
        if self._tool_check is not None and "tools" in call.body:
            for r in records:
                if r.status == "ok":
                    errors = self._tool_check.errors(call.body["tools"], r)
                    for error in errors or ():
                        metrics.tool_call_errors.labels(error["kind"]).inc()
                    # (a schema holding a U+0000 may be quoted in a detail)
                    r.tool_errors = wire.pg_safe(errors) if call.scrub else errors
        stored = call.body.get("store") is not False and records[0].status == "ok"
        if call.response_id and call.served_by and stored:
            self._upstream.remember(call.response_id, call.served_by)
        if call.endpoint is wire.RESPONSES and call.served_by and needs_scoring(records[0]):
            self._scorer.submit(call.served_by, records[0])  # it hands the record on
        else:
            self._recorder.submit(records)
        elapsed = time.perf_counter() - call.started
        _UPSTREAM_LATENCY[call.endpoint.name].observe(call.upstream_s)
        _PROXY_OVERHEAD[call.endpoint.name].observe(max(0.0, elapsed - call.upstream_s))


class RelayResponse(Response):
    """A stream (SSE) whose relay is always closed when the response ends, however it ends.

    A client that disconnects ends the stream: a watcher task waits for uvicorn's
    `http.disconnect` and cancels the sending task (Starlette's StreamingResponse does the same
    with an anyio task group per response, which cost ~0.4 ms of CPU per streamed call here).
    The relay may then be parked at a `yield` or not started at all, and its `finally` (close
    vLLM's request, record the transition as aborted) would run only when garbage-collected, or
    never: it is closed here, and `after` covers "never started".
    """

    media_type = "text/event-stream"

    def __init__(
        self, relay: AsyncGenerator[bytes], headers: dict[str, str], after: Callable[[], None]
    ) -> None:
        self.status_code = 200
        self.init_headers(headers)
        self._relay, self._after = relay, after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.current_task()
        assert sending is not None
        left = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            sending.cancel()  # lands at the await the sender is parked on, inside the try

        watcher = asyncio.create_task(watch())
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            async for chunk in self._relay:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left or sending.uncancel() > 0:  # cancelled by someone else too
                raise
        finally:
            watcher.cancel()
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


def _choices(endpoint: wire.Endpoint, body: dict[str, Any]) -> int:
    """How many transitions a chat or completions call records (n x prompts)."""
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ApiError(400, "`n` must be a positive integer", param="n")
    choices = n * wire.prompt_count(body) if endpoint is wire.COMPLETIONS else n
    if choices > MAX_CHOICES:
        raise ApiError(400, f"n x prompts = {choices} exceeds {MAX_CHOICES}", param="n")
    return int(choices)


def _upstream_body(call: Call, model_used: str) -> dict[str, Any]:
    """The request as vLLM gets it: the alias resolved, token ids and logprobs always asked for."""
    if call.endpoint is wire.RESPONSES:
        return {**responses.upstream_body(call.body), "model": model_used}
    upstream_body = {**call.body, "model": model_used, "return_token_ids": True}
    if call.endpoint is wire.CHAT:
        upstream_body["logprobs"] = True
    elif not call.wants_logprobs:
        upstream_body["logprobs"] = 0  # completions: 0 = the sampled token's logprob only
    return upstream_body


def _collect(endpoint: wire.Endpoint, data: dict[str, Any]) -> dict[int, wire.Choice]:
    if endpoint is not wire.RESPONSES:
        return wire.collect(endpoint, data)
    choice = wire.Choice()
    responses.read(data, choice)
    return {0: choice}


def _strip(call: Call, data: dict[str, Any]) -> None:
    """Remove what the proxy added to the request from a response or a stream event, in place."""
    token_ids, logprobs = call.wants_token_ids, call.wants_logprobs
    if call.endpoint is not wire.RESPONSES:
        wire.strip(data, token_ids=token_ids, logprobs=logprobs)
    elif "object" in data:  # a response object, or else an event
        responses.strip(data, token_ids=token_ids, logprobs=logprobs)
    else:
        responses.strip_event(data, token_ids=token_ids, logprobs=logprobs)
