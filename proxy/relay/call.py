"""One completion call in flight, and the transitions it records (one per choice).

`Call` holds what the forwarder knows about a call: its endpoint and tags, what the client asked
for, the model and policy version it was sent to, its ids and timings. `choice_count()` says how
many transitions a request records; `transitions()` and `failure()` turn a finished call into
those `TransitionRecord`s.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from core.record import TransitionRecord
from proxy.errors import ApiError
from proxy.relay import messages, responses, wire
from proxy.relay.tags import Tags
from proxy.relay.upstream import Replica

MAX_CHOICES = 256  # n x prompts per call; more is almost certainly a client bug


@dataclass
class Call:
    endpoint: wire.Endpoint
    tags: Tags
    body: dict[str, Any]
    model_used: str
    policy_version: int | None
    lineage: str | None  # the lineage whose policy serves it (None: not the policy)
    transition_ids: list[str]
    request_id: str
    requested_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)
    upstream_s: float = 0.0
    recorded: bool = False
    watched: list[asyncio.Future[None]] = field(default_factory=list)  # durable mode
    replica: Replica | None = None  # holds an outstanding slot there while set
    served_by: str | None = None  # the base URL of the replica that answered
    response_id: str | None = None  # the Responses API's id of what it answered
    scrub: bool = False  # the request holds a U+0000: make the records storable

    @property
    def wants_logprobs(self) -> bool:
        if self.endpoint is wire.RESPONSES:
            return responses.wants(self.body)[1]
        value = self.body.get("logprobs")
        return value is not None and value is not False

    @property
    def wants_token_ids(self) -> bool:
        if self.endpoint is wire.RESPONSES:
            return responses.wants(self.body)[0]
        return bool(self.body.get("return_token_ids"))

    def headers(self) -> dict[str, str]:
        version = "none" if self.policy_version is None else str(self.policy_version)
        return {
            "X-Episode-Id": self.tags.public_episode_id or self.tags.episode_id,
            "X-Transition-Id": ",".join(self.transition_ids),
            "X-Policy-Version": version,  # 0: the base model
            "X-Policy-Lineage": self.lineage or "none",
        }


def choice_count(endpoint: wire.Endpoint, body: dict[str, Any]) -> int:
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


def transitions(
    call: Call, collected: dict[int, wire.Choice], status: str
) -> list[TransitionRecord]:
    """One record per choice of a call that vLLM answered (`status` "ok", or "aborted" when the
    stream ended early; missing choices are recorded empty)."""
    records = []
    for index, transition_id in enumerate(call.transition_ids):
        choice = collected.get(index, wire.Choice())
        record = _record(call, index, transition_id, status, 200)
        record.prompt_token_ids = choice.prompt_token_ids
        record.completion_token_ids = choice.token_ids
        record.logprobs = choice.logprobs
        record.text = "".join(choice.text)
        record.tool_calls = [choice.tool_calls[i] for i in sorted(choice.tool_calls)] or None
        record.finish_reason = choice.finish_reason
        record.prompt_tokens = len(choice.prompt_token_ids or ())
        record.completion_tokens = len(choice.token_ids)
        records.append(record)
    return records


def failure(
    call: Call, http_status: int, payload: bytes, partial: dict[int, wire.Choice] | None = None
) -> list[TransitionRecord]:
    """The records of a failed call, one per choice (the client was given every id in
    X-Transition-Id): vLLM's error body (or ours), and any text each streamed before it failed."""
    try:
        error = orjson.loads(payload)
    except orjson.JSONDecodeError:
        error = {"raw": payload[:10_000].decode(errors="replace")}
    records = []
    for index, transition_id in enumerate(call.transition_ids):
        record = _record(call, index, transition_id, "failed", http_status)
        record.error = error if isinstance(error, dict) else {"raw": error}
        if partial:
            record.text = "".join(partial.get(index, wire.Choice()).text)
        records.append(record)
    return records


def _record(
    call: Call, index: int, transition_id: str, status: str, http_status: int
) -> TransitionRecord:
    body = call.body
    prompt_key = call.endpoint.prompt_key
    unrecorded: tuple[str, ...] = (prompt_key,)  # params: the request minus the prompt
    if call.endpoint is wire.CHAT:
        sent = body.get(prompt_key)
        prompt_messages = sent if isinstance(sent, list) else []
    elif call.endpoint is wire.RESPONSES:
        prompt_messages = responses.prompt_messages(body)
        unrecorded = (prompt_key, "instructions")
    elif call.endpoint is wire.MESSAGES:
        prompt_messages = messages.prompt_messages(body)
        unrecorded = (prompt_key, "system")
    else:
        prompts = wire.prompts(body.get(prompt_key))
        n = len(call.transition_ids) // max(1, len(prompts))
        prompt_messages = [{"prompt": prompts[index // max(1, n)]}] if prompts else []
    return TransitionRecord(
        id=transition_id,
        episode_id=call.tags.episode_id,
        request_id=call.request_id,
        choice_index=index,
        task_id=call.tags.task_id,
        agent_name=call.tags.agent_name,
        requested_at=call.requested_at,
        route=call.endpoint.name,
        status=status,
        http_status=http_status,
        model_requested=body.get("model"),
        model_used=call.model_used,
        policy_version=call.policy_version,
        lineage=call.lineage,
        messages=prompt_messages,
        params={k: v for k, v in body.items() if k not in unrecorded},
        latency_ms=call.upstream_s * 1000.0,
    )


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
