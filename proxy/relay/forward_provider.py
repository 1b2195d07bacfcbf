"""Forwarding a call to a provider model (FLYWHEEL_ROUTES) through litellm (providers.py) and
recording it like any other: as transitions of its agent and episode, but with no token ids, no
logprobs and no lineage (a trainer never claims them), the provider's token counts and its price.
Only chat completions go to providers.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from functools import partial
from typing import Any

import orjson
from starlette.responses import Response

from core.record import TransitionRecord
from proxy import metrics
from proxy.config import ProviderModel
from proxy.errors import ApiError
from proxy.relay import wire
from proxy.relay.call import Call, choice_count, failure, random_uuids, transitions
from proxy.relay.handoff import Handoff
from proxy.relay.providers import ProviderFailed, Providers
from proxy.relay.sse import RelayResponse
from proxy.relay.tags import Tags


class ProviderForwarder:
    def __init__(
        self, *, providers: Providers, handoff: Handoff, max_n: int, max_body_bytes: int
    ) -> None:
        self._providers = providers
        self._handoff = handoff
        # Every choice and every byte is paid on the operator's key: bounded per call.
        self._max_n = max_n  # FLYWHEEL_ROUTE_MAX_N
        self._max_body_bytes = max_body_bytes  # FLYWHEEL_ROUTE_MAX_BODY_BYTES

    def get(self, model: str) -> ProviderModel | None:
        """The provider model of this name (None: vLLM serves it)."""
        return self._providers.get(model)

    async def forward(
        self,
        provider_model: ProviderModel,
        body: dict[str, Any],
        tags: Tags,
        *,
        stream: bool,
        scrub: bool,
    ) -> Response:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:  # (vLLM would say so; litellm crashes)
            raise ApiError(400, "`messages` must be a non-empty list", param="messages")
        self._check_size(body)
        *transition_ids, request_id = random_uuids(choice_count(wire.CHAT, body) + 1)
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
            self._handoff.hand_over(
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
                self._relay(call, provider_model, chunks, sent),
                call.headers(),
                after=partial(self._end_stream, call, provider_model),
            )
        call.upstream_s = time.perf_counter() - sent
        records = transitions(call, wire.collect(wire.CHAT, data), "ok")
        self._handoff.hand_over(call, self._provided(provider_model, records, data.get("usage")))
        await self._handoff.safe(call)
        return Response(orjson.dumps(data), media_type="application/json", headers=call.headers())

    def _check_size(self, body: dict[str, Any]) -> None:
        """The caps on what one call may ask of a provider: choices and bytes."""
        n = choice_count(wire.CHAT, body)
        if n > self._max_n:
            raise ApiError(
                400,
                f"`n` = {n} exceeds {self._max_n}, the most choices one call to a provider model "
                "may ask for on this proxy (FLYWHEEL_ROUTE_MAX_N)",
                param="n",
                code="n_too_large",
            )
        size = len(orjson.dumps(body))  # what litellm is sent, give or take its own fields
        if size > self._max_body_bytes:
            raise ApiError(
                413,
                f"request body of {size} bytes exceeds {self._max_body_bytes}, the most one call "
                "to a provider model may send on this proxy (FLYWHEEL_ROUTE_MAX_BODY_BYTES)",
                code="payload_too_large",
            )

    async def _relay(
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
            self._handoff.hand_over(call, self._provided(provider_model, records, usage))
        if status == "ok":
            await self._handoff.safe(call)
            yield b"data: [DONE]\n\n"

    def _end_stream(self, call: Call, provider_model: ProviderModel) -> None:
        if not call.recorded:  # the client left before the relay's first step
            self._handoff.hand_over(
                call, self._provided(provider_model, transitions(call, {}, "aborted"))
            )

    def _provided(
        self,
        provider_model: ProviderModel,
        records: list[TransitionRecord],
        usage: dict[str, Any] | None = None,
    ) -> list[TransitionRecord]:
        """Mark a provider's call's records: its provider, the provider's token counts (the n
        choices share the prompt; their completions are counted apart only when n is 1), and
        the call's price on its first choice."""
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
