"""A finished call's records, handed over to the record wing through its door
(proxy/record/intake.py, which makes the recording decision), with the relay's own part of it:
the replica that keeps a Responses API answer is remembered (a `previous_response_id` chain goes
back to it), a record that vLLM left without logprobs goes to the scorer first, and the call's
upstream time and the proxy's overhead are observed.
"""

from __future__ import annotations

import time

from core.record import TransitionRecord
from proxy import metrics
from proxy.record.intake import Intake
from proxy.relay import wire
from proxy.relay.call import Call
from proxy.relay.scoring import Scorer, needs_scoring
from proxy.relay.upstream import Upstream

# labels() takes a lock and a lookup per call: the children, once
_UPSTREAM_LATENCY = {e.name: metrics.upstream_latency.labels(e.name) for e in wire.ENDPOINTS}
_PROXY_OVERHEAD = {e.name: metrics.proxy_overhead.labels(e.name) for e in wire.ENDPOINTS}


class Handoff:
    def __init__(self, *, intake: Intake, upstream: Upstream, scorer: Scorer) -> None:
        self._intake = intake
        self._upstream = upstream
        self._scorer = scorer

    def hand_over(self, call: Call, records: list[TransitionRecord]) -> None:
        """Once per call, however it ended; never awaited."""
        call.recorded = True
        call.watched = self._intake.watch(records)
        records = self._intake.prepare(records, tools=call.body.get("tools"), scrub=call.scrub)
        stored = call.body.get("store") is not False and records[0].status == "ok"
        if call.response_id and call.served_by and stored:
            self._upstream.remember(call.response_id, call.served_by)
        if call.endpoint is wire.RESPONSES and call.served_by and needs_scoring(records[0]):
            self._scorer.submit(call.served_by, records[0])  # it hands the record on
        else:
            self._intake.submit(records)
        elapsed = time.perf_counter() - call.started
        _UPSTREAM_LATENCY[call.endpoint.name].observe(call.upstream_s)
        _PROXY_OVERHEAD[call.endpoint.name].observe(max(0.0, elapsed - call.upstream_s))

    async def safe(self, call: Call) -> None:
        """Durable mode: wait until the call's records are committed or journaled."""
        await self._intake.safe(call.watched)
