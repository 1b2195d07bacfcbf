"""Recorded calls as OpenTelemetry spans, for teams that already run Jaeger, Tempo or Langfuse.

Off unless FLYWHEEL_OTEL_ENDPOINT is set (then nothing here is imported or run). On, every
transition the recorder accepts becomes one span, after the call (from its recorded times), in
its episode's trace: the trace id is the first 16 bytes of BLAKE2b(episode id), so every call of
an episode, on any replica, lands in one trace without any header passing between them; its
parent is a remote span of the same derivation (the episode itself, never emitted).

Names and attributes follow the OpenTelemetry GenAI semantic conventions (`gen_ai.*`: operation,
request and response model, token usage, finish reasons, conversation id = episode id, agent
name), with Flywheel's own under `flywheel.*` (transition, task, policy version, lineage,
status). Prompts and completions are not put in spans: they are in Postgres, by transition id.

The SDK's BatchSpanProcessor queues the spans and exports them over OTLP/HTTP from its own
thread; the event loop only builds them. A full queue drops spans (the SDK counts them), never
calls.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from core.record import TransitionRecord

# The GenAI operation name of each endpoint (proxy/relay/wire.py's Endpoint names).
_OPERATIONS = {
    "chat": "chat",
    "completions": "text_completion",
    "responses": "chat",
    "messages": "chat",
}


def _ids(episode_id: str) -> tuple[int, int]:
    digest = hashlib.blake2b(episode_id.encode(), digest_size=24).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:], "big") or 1


class Spans:
    def __init__(self, endpoint: str, service_name: str) -> None:
        """`endpoint`: an OTLP/HTTP traces URL; headers (an API key) come from the SDK's own
        OTEL_EXPORTER_OTLP_TRACES_HEADERS / OTEL_EXPORTER_OTLP_HEADERS variables."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        # The spans are made finished, from the record (a ReadableSpan is what processors and
        # exporters take): the SDK's live-span path (sampler, attribute checks, locks) cost the
        # event loop 130 us a call, for values that are already known and well-typed.
        self._processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        resource = Resource.create({"service.name": service_name})
        scope = InstrumentationScope("flywheel.proxy")
        sampled = TraceFlags(TraceFlags.SAMPLED)
        ok, error = Status(StatusCode.UNSET), Status(StatusCode.ERROR)

        def span(r: TransitionRecord) -> ReadableSpan:
            operation = _OPERATIONS.get(r.route, r.route)
            trace_id, parent_id = _ids(r.episode_id)
            start_ns = int(r.requested_at * 1e9)
            return ReadableSpan(
                name=f"{operation} {r.model_requested or ''}".rstrip(),
                context=SpanContext(
                    trace_id, random.getrandbits(64) or 1, is_remote=False, trace_flags=sampled
                ),
                parent=SpanContext(trace_id, parent_id, is_remote=True, trace_flags=sampled),
                resource=resource,
                attributes=_attributes(r, operation),
                kind=SpanKind.CLIENT,
                instrumentation_scope=scope,
                status=ok if r.status == "ok" else error,
                start_time=start_ns,
                end_time=start_ns + int(r.latency_ms * 1e6),
            )

        self._span = span

    def emit(self, records: list[TransitionRecord]) -> None:
        for r in records:
            self._processor.on_end(self._span(r))

    def flush(self, timeout_s: float = 10.0) -> bool:
        return bool(self._processor.force_flush(int(timeout_s * 1000)))

    def close(self) -> None:
        self._processor.shutdown()  # type: ignore[no-untyped-call]  # exports what is queued


def _attributes(r: TransitionRecord, operation: str) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": r.provider or "vllm",  # a provider model's call: its provider
        "gen_ai.conversation.id": r.episode_id,
        "flywheel.transition_id": r.id,
        "flywheel.request_id": r.request_id,
        "flywheel.route": r.route,
        "flywheel.status": r.status,
        "http.response.status_code": r.http_status,
    }
    optional = {
        "gen_ai.request.model": r.model_requested,
        "gen_ai.response.model": r.model_used,
        "gen_ai.agent.name": r.agent_name,
        "gen_ai.usage.input_tokens": r.prompt_tokens,
        "gen_ai.usage.output_tokens": r.completion_tokens,
        "gen_ai.response.finish_reasons": [r.finish_reason] if r.finish_reason else None,
        "flywheel.task_id": r.task_id,
        "flywheel.policy_version": r.policy_version,
        "flywheel.lineage": r.lineage,
        "flywheel.cost_usd": r.cost_usd,  # a provider model's call's price (litellm's)
    }
    attributes.update((k, v) for k, v in optional.items() if v is not None)
    return attributes
