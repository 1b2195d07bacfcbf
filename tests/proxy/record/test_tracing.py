"""OpenTelemetry spans of recorded calls (issue 15, part 5): the proxy on the fake vLLM and real
Postgres exports to an OTLP/HTTP receiver here, decoded with OpenTelemetry's own protobufs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from demo.vllm_server import free_port
from fakes.vllm import FakeVLLM
from proxy.record.tracing import _ids


class Receiver:
    """An OTLP/HTTP traces endpoint: every span posted to it, decoded."""

    def __init__(self) -> None:
        self.spans: list[tuple[Any, Any]] = []  # (resource, span)
        received = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        received.extend((resource_spans.resource, s) for s in scope_spans.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind)


def test_each_recorded_call_is_a_span_in_its_episodes_trace(
    make_proxy: Any, fake_vllm: FakeVLLM, receiver: Receiver
) -> None:
    proxy = make_proxy(otel_endpoint=receiver.url, otel_service_name="proxy-under-test")
    headers = {"X-Task-Id": "sum", "X-Agent-Name": "solver"}
    chat = {"model": "policy", "messages": [{"role": "user", "content": "1+1"}], "max_tokens": 4}
    with proxy.client(**headers) as c:
        ids = [
            c.post("/v1/chat/completions", json=chat, headers={"X-Episode-Id": e}).headers[
                "x-transition-id"
            ]
            for e in ["e1", "e1", "e2"]
        ]
        fake_vllm.fail_next(1, status=400)  # vLLM refuses one: recorded as failed
        failed = c.post("/v1/chat/completions", json=chat, headers={"X-Episode-Id": "e2"})
    assert failed.status_code == 400
    assert proxy.services.spans is not None and proxy.services.spans.flush()
    deadline = time.monotonic() + 10
    while len(receiver.spans) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)

    by_id = {}
    for resource, span in receiver.spans:
        attrs = {a.key: value(a.value) for a in span.attributes}
        by_id[attrs["flywheel.transition_id"]] = (resource, span, attrs)
    assert set(ids) <= set(by_id)
    rows = proxy.wait_rows(
        "SELECT id::text, episode_id, extract(epoch FROM requested_at), latency_ms, "
        "prompt_tokens, completion_tokens, policy_version FROM transition WHERE status = 'ok'",
        3,
    )
    assert len(rows) == 3
    for tid, episode, requested_at, latency_ms, prompt_tokens, completion_tokens, version in rows:
        resource, span, attrs = by_id[tid]
        assert {a.key: value(a.value) for a in resource.attributes}["service.name"] == (
            "proxy-under-test"
        )
        assert span.name == "chat policy" and span.kind == span.SPAN_KIND_CLIENT
        trace_id, parent_id = _ids(episode)  # one trace per episode, on any replica
        assert span.trace_id == trace_id.to_bytes(16, "big")
        assert span.parent_span_id == parent_id.to_bytes(8, "big")
        assert span.start_time_unix_nano == pytest.approx(float(requested_at) * 1e9, abs=1e3)
        took = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
        assert took == pytest.approx(latency_ms, abs=1e-3)
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.conversation.id"] == episode
        assert attrs["gen_ai.agent.name"] == "solver" and attrs["flywheel.task_id"] == "sum"
        assert attrs["gen_ai.request.model"] == "policy"
        assert attrs["gen_ai.usage.input_tokens"] == prompt_tokens
        assert attrs["gen_ai.usage.output_tokens"] == completion_tokens
        assert attrs["flywheel.policy_version"] == version and attrs["flywheel.status"] == "ok"
        assert span.status.code != span.status.STATUS_CODE_ERROR
    assert by_id[ids[0]][1].trace_id == by_id[ids[1]][1].trace_id != by_id[ids[2]][1].trace_id

    # The refused call: recorded, and its span marked an error.
    [(tid,)] = proxy.wait_rows("SELECT id::text FROM transition WHERE status = 'failed'", 1)
    _, span, attrs = by_id[tid]
    assert span.status.code == span.status.STATUS_CODE_ERROR
    assert (attrs["flywheel.status"], attrs["http.response.status_code"]) == ("failed", 400)


def test_off_by_default(proxy: Any) -> None:
    assert proxy.services.spans is None
