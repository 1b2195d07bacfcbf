"""Forwarding one completion call to vLLM, and its answer back to the client.

The request goes upstream as the client wrote it (an Anthropic Messages call as a chat call:
messages.py), except: the model alias is resolved, and vLLM is always asked for token ids and
sampled-token logprobs (`return_token_ids` and `logprobs` on chat and completions;
`enable_response_messages` and output logprobs on the Responses API, see responses.py). On the
way back those are removed again where the client did not ask for them, so the client sees what
vLLM would have sent it (Messages: its answer in Anthropic's shape, messages_answer.py). Each
choice becomes one transition, handed over to the record wing (handoff.py; never awaited here).

A provider model (FLYWHEEL_ROUTES) goes to forward_provider.py instead.

A stream's terminal event (`[DONE]`, or the Responses API's `response.completed`) reaches the
client only after the call's records are queued for the writer, as a non-streaming body does: a
reward or an episode read sent the moment the client has the answer waits for them.

Durable mode (FLYWHEEL_DURABLE): a successful answer is released only once its transitions are
committed or fsync'd to the journal: a non-streaming body after that, a stream's terminal event
held until then (proxy/record/intake.py says how long).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from functools import partial
from typing import Any

import orjson
from starlette.responses import Response

from proxy import metrics
from proxy.errors import ApiError, anthropic_error_response, error_response
from proxy.relay import messages, messages_answer, responses, wire
from proxy.relay.alias import PolicyAlias
from proxy.relay.call import Call, choice_count, failure, random_uuids, transitions
from proxy.relay.forward_provider import ProviderForwarder
from proxy.relay.handoff import Handoff
from proxy.relay.http1 import Response as UpstreamResponse
from proxy.relay.http1 import UpstreamBroken
from proxy.relay.sse import RelayResponse, sse_events
from proxy.relay.tags import Tags
from proxy.relay.upstream import Replica, Upstream

log = logging.getLogger(__name__)

# What a completion call to vLLM can raise (alias.restore handles its own errors).
UPSTREAM_ERRORS = (UpstreamBroken, TimeoutError)


class Forwarder:
    def __init__(
        self,
        *,
        upstream: Upstream,
        alias: PolicyAlias,
        handoff: Handoff,
        providers: ProviderForwarder | None = None,
    ) -> None:
        self._upstream = upstream
        self._alias = alias
        self._handoff = handoff  # the records, to the record wing
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
        providers = self._providers
        provider_model = providers.get(model) if providers is not None else None
        if providers is not None and provider_model is not None:
            if endpoint is not wire.CHAT:
                raise ApiError(
                    400,
                    f"model {model!r} is served by a provider (FLYWHEEL_ROUTES), "
                    "through /v1/chat/completions only",
                    param="model",
                )
            return await providers.forward(
                provider_model, body, tags, stream=bool(stream), scrub=scrub
            )
        choices = 1
        if endpoint is wire.RESPONSES:
            responses.check(body)  # one model call, one transition
        elif endpoint is wire.MESSAGES:
            messages.check(body)  # no `n`: one transition
        else:
            choices = choice_count(endpoint, body)

        resolved = await self._alias.resolve(model, tags.agent_name, tags.episode_id, tags.tenant)
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
            self._handoff.hand_over(call, failure(call, response.status, payload))
            media_type = response.content_type
            if call.endpoint is wire.MESSAGES:
                payload = messages_answer.error_body(response.status, payload)
                media_type = "application/json"
            return Response(
                payload, status_code=response.status, media_type=media_type, headers=call.headers()
            )
        data = orjson.loads(payload)
        collected = _collect(call.endpoint, data)
        if call.endpoint is wire.RESPONSES:
            call.response_id = data.get("id")
        if call.endpoint is wire.MESSAGES:
            payload = orjson.dumps(messages_answer.message(call.request_id, data))
        elif not (call.wants_logprobs and call.wants_token_ids):
            _strip(call, data)
            payload = orjson.dumps(data)
        self._handoff.hand_over(call, transitions(call, collected, "ok"))
        await self._handoff.safe(call)
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
        path = call.endpoint.upstream_path
        response = await self._upstream.post(replica, path, body)
        if response.status == 404 and call.policy_version:
            # A restarted vLLM has none of our adapters: load this one again and retry once.
            await response.read()  # kept: the 404 can still be passed through
            response.release()
            if await self._alias.restore(replica, call.model_used):
                response = await self._upstream.post(replica, path, body)
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
        read from vLLM, not one per event (a socket write each, the relay's largest cost).

        The block holding the terminal event (`[DONE]`, or the Responses API's `response.*` end)
        leaves only once the call's records are queued for the writer (durable mode: safe), so a
        reward or an episode read sent the moment the client sees the end finds the call."""
        collected: dict[int, wire.Choice] = {}
        status, error = "aborted", None
        detailed = call.wants_logprobs and call.wants_token_ids
        anthropic = None  # the Messages API: Anthropic's events made of the chat chunks
        if call.endpoint is wire.MESSAGES:
            anthropic = messages_answer.Stream(
                call.request_id, collected.setdefault(0, wire.Choice())
            )
        try:
            async for events in sse_events(response):
                out, ended = [], False
                for name, data_bytes in events:
                    if data_bytes == b"[DONE]":  # chat and completions
                        status, ended = ("ok" if error is None else "failed"), True
                        out.append(anthropic.end() if anthropic else b"data: [DONE]\n\n")
                        continue
                    chunk = orjson.loads(data_bytes)
                    if call.endpoint is wire.RESPONSES:
                        end = responses.read_event(chunk, collected.setdefault(0, wire.Choice()))
                        if end is not None:
                            status, ended = end, True
                            call.response_id = (chunk.get("response") or {}).get("id")
                            if end == "failed":
                                error = responses.error_of(chunk)
                    elif "error" in chunk:
                        error = chunk
                    else:
                        wire.collect_chunk(call.endpoint, chunk, collected)
                    if anthropic is not None:
                        out.append(anthropic.event(chunk))
                        continue
                    if not detailed and error is None:
                        _strip(call, chunk)
                        data_bytes = orjson.dumps(chunk)
                    head = b"event: " + name + b"\ndata: " if name else b"data: "
                    out.append(head + data_bytes + b"\n\n")
                if ended and not call.recorded:
                    self._hand_over_stream(call, collected, status, error, sent)
                    await self._handoff.safe(call)  # durable mode (else at once)
                if out:
                    yield b"".join(out)
        except UPSTREAM_ERRORS as e:
            status, error = "failed", {"error": {"message": f"upstream stream broke: {e}"}}
            log.warning("upstream stream broke: %s", e)
        finally:
            # Reached at the stream's end, on an upstream error, and when the client disconnects
            # (the response task is cancelled): closing the connection makes vLLM abort the
            # request. The records of a stream that ended are handed over already.
            if status == "ok":
                response.release()
            else:
                response.close()
            if not call.recorded:
                self._hand_over_stream(call, collected, status, error, sent)

    def _hand_over_stream(
        self,
        call: Call,
        collected: dict[int, wire.Choice],
        status: str,
        error: dict[str, Any] | None,
        sent: float,
    ) -> None:
        call.upstream_s = time.perf_counter() - sent
        if error is not None:
            records = failure(call, 200, orjson.dumps(error), partial=collected)
        else:
            records = transitions(call, collected, status)
        self._handoff.hand_over(call, records)

    def _end_stream(self, call: Call, response: UpstreamResponse) -> None:
        self._free(call)
        if not call.recorded:  # the client left before the relay's first step
            response.close()
            self._handoff.hand_over(call, transitions(call, {}, "aborted"))

    def _failed_to_connect(self, call: Call, e: Exception, sent: float) -> Response:
        call.upstream_s = time.perf_counter() - sent
        timeout = isinstance(e, TimeoutError)
        status = 504 if timeout else 502
        message = f"upstream vLLM {'timed out' if timeout else 'unreachable'}"
        detail = {"error": {"message": f"{message}: {e!r}"}}  # recorded; the client gets no URL
        self._handoff.hand_over(call, failure(call, status, orjson.dumps(detail)))
        if call.endpoint is wire.MESSAGES:
            return anthropic_error_response(status, message, headers=call.headers())
        return error_response(
            status,
            message,
            type="upstream_error",
            code="upstream_timeout" if timeout else "upstream_unreachable",
            headers=call.headers(),
        )


def _upstream_body(call: Call, model_used: str) -> dict[str, Any]:
    """The request as vLLM gets it: the alias resolved, token ids and logprobs always asked for."""
    if call.endpoint is wire.RESPONSES:
        return {**responses.upstream_body(call.body), "model": model_used}
    body = messages.chat_request(call.body) if call.endpoint is wire.MESSAGES else call.body
    upstream_body = {**body, "model": model_used, "return_token_ids": True}
    if call.endpoint.chat_answers:
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
