"""The Anthropic Messages API, the answer side: vLLM's chat answer (messages.py says why the proxy
asks for one) turned into what Anthropic's API answers, as vLLM 0.32's `messages_full_converter`
and `message_stream_converter` do (vllm/entrypoints/anthropic/serving.py):

- a message object: `id` ("msg_" and the call's request id), `type` "message", `role`, `model`,
  `content` blocks (`thinking` from the chat answer's reasoning, `text`, one `tool_use` per tool
  call, its arguments parsed; an empty answer is one empty text block), `stop_reason`
  (`stop_reason()`), `stop_sequence`, `usage` (`input_tokens`, `output_tokens`);
- a stream: `message_start`, then per content block `content_block_start`, its deltas
  (`text_delta`, `thinking_delta`, `input_json_delta`) and `content_block_stop`, then
  `message_delta` (stop reason, usage) and `message_stop` where the chat stream said `[DONE]`;
  an `error` event for vLLM's error chunk;
- vLLM's error bodies (OpenAI-shaped) re-said in Anthropic's shape.

The token ids and logprobs the proxy asked for stay in the record: Anthropic's shape has no place
for them.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from proxy.errors import anthropic_body
from proxy.relay.wire import Choice


def message_id(request_id: str) -> str:
    return "msg_" + request_id.replace("-", "")


def stop_reason(
    finish: str | None, matched: Any, *, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason and vLLM's `stop_reason` (the matched
    stop string; an int is a stop token), as vLLM maps them: a complete tool call wins over a
    stop string, `max_tokens` over everything."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def message(request_id: str, data: dict[str, Any]) -> dict[str, Any]:
    """The message object of a chat completion (its first choice: Messages has no `n`)."""
    choice = (data.get("choices") or [{}])[0]
    chat = choice.get("message") or {}
    calls = chat.get("tool_calls") or []
    content: list[dict[str, Any]] = []
    if chat.get("reasoning"):
        content.append(
            {"type": "thinking", "thinking": chat["reasoning"], "signature": uuid.uuid4().hex}
        )
    if chat.get("content"):
        content.append({"type": "text", "text": chat["content"]})
    for call in calls:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": _input(function.get("arguments")),
            }
        )
    reason, sequence = stop_reason(
        choice.get("finish_reason"),
        choice.get("stop_reason"),
        tool_used=bool(calls),
        tool_complete=bool(calls),
    )
    return {
        "id": message_id(request_id),
        "type": "message",
        "role": "assistant",
        "model": data.get("model"),
        "content": content or [{"type": "text", "text": ""}],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(data.get("usage") or {}),
    }


def usage(chat_usage: dict[str, Any]) -> dict[str, int]:
    """Anthropic's input_tokens leave out the cached ones (reported beside them), as vLLM's."""
    out = {"input_tokens": 0, "output_tokens": chat_usage.get("completion_tokens") or 0}
    prompt = chat_usage.get("prompt_tokens") or 0
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        out["cache_read_input_tokens"] = cached
        prompt -= cached
    out["input_tokens"] = max(0, prompt)
    return out


def _input(arguments: Any) -> Any:
    """A tool call's arguments as a `tool_use` input. vLLM's tool parsers hand over JSON; were it
    not (a broken call), the client gets {} and the record keeps what the model wrote."""
    try:
        parsed = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def error_body(status: int, payload: bytes) -> bytes:
    """vLLM's error answer (`{"error": {"message", ...}}`) in Anthropic's shape."""
    try:
        error = orjson.loads(payload).get("error")
        text = error.get("message") if isinstance(error, dict) else error
    except (orjson.JSONDecodeError, AttributeError):
        text = None
    return anthropic_body(status, str(text or payload[:2000].decode(errors="replace")))


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class Stream:
    """A chat completion stream's chunks turned into Anthropic's events, one chunk at a time.
    `choice` is the one the forwarder collects the chunks into (its prompt ids and token ids
    give the usage)."""

    def __init__(self, request_id: str, choice: Choice) -> None:
        self._id = message_id(request_id)
        self._choice = choice
        self._started = self._failed = False
        self._blocks = 0  # content blocks started so far
        self._open: str | None = None  # the open block's type
        self._tool: int | None = None  # the open tool_use block's chat tool-call index
        self._finish: str | None = None
        self._matched: Any = None  # vLLM's `stop_reason`
        self._tool_used = False
        self._last_args: list[str] = []

    def event(self, chunk: dict[str, Any]) -> bytes:
        """The events of one chat chunk (already collected into the choice)."""
        if "error" in chunk:
            self._failed = True
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            message = str(error.get("message") or chunk["error"])
            return _event("error", orjson.loads(anthropic_body(500, message)))
        out = []
        if not self._started:
            self._started = True
            out.append(self._message_start(chunk.get("model")))
        for c in chunk.get("choices") or ():
            if c.get("index", 0) != 0:
                continue
            if c.get("finish_reason") is not None:
                self._finish, self._matched = c["finish_reason"], c.get("stop_reason")
            delta = c.get("delta") or {}
            if delta.get("reasoning"):
                out += self._delta("thinking", {"type": "thinking", "thinking": ""})
                out.append(
                    self._block_delta({"type": "thinking_delta", "thinking": delta["reasoning"]})
                )
            if delta.get("content"):
                out += self._delta("text", {"type": "text", "text": ""})
                out.append(self._block_delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                out += self._tool_call(call)
        return b"".join(out)

    def end(self) -> bytes:
        """The events where the chat stream said `[DONE]` (none after an error event)."""
        if self._failed:
            return b""
        out = [] if self._started else [self._message_start(None)]
        out += self._close()
        complete = self._tool_used and _is_json("".join(self._last_args))
        reason, sequence = stop_reason(
            self._finish or "stop", self._matched, tool_used=self._tool_used, tool_complete=complete
        )
        counts = {
            "input_tokens": len(self._choice.prompt_token_ids or ()),
            "output_tokens": len(self._choice.token_ids),
        }
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out.append(
            _event("message_delta", {"type": "message_delta", "delta": delta, "usage": counts})
        )
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def _message_start(self, model: Any) -> bytes:
        counts = {"input_tokens": len(self._choice.prompt_token_ids or ()), "output_tokens": 0}
        started = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": counts,
        }
        return _event("message_start", {"type": "message_start", "message": started})

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        out = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        if (
            call.get("id")
            and function.get("name")
            and (self._open, self._tool) != ("tool_use", index)
        ):
            block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
            out += self._close()
            out.append(self._start(block))
            self._tool, self._tool_used, self._last_args = index, True, []
        if function.get("arguments") and (self._open, self._tool) == ("tool_use", index):
            self._last_args.append(function["arguments"])
            out.append(
                self._block_delta(
                    {"type": "input_json_delta", "partial_json": function["arguments"]}
                )
            )
        return out

    def _delta(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        """Open a block of this kind unless one is open already."""
        if self._open == kind:
            return []
        return [*self._close(), self._start(block)]

    def _start(self, block: dict[str, Any]) -> bytes:
        self._open = block["type"]
        start = {"type": "content_block_start", "index": self._blocks, "content_block": block}
        return _event("content_block_start", start)

    def _block_delta(self, delta: dict[str, Any]) -> bytes:
        data = {"type": "content_block_delta", "index": self._blocks, "delta": delta}
        return _event("content_block_delta", data)

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            out.append(
                self._block_delta({"type": "signature_delta", "signature": uuid.uuid4().hex})
            )
        out.append(
            _event("content_block_stop", {"type": "content_block_stop", "index": self._blocks})
        )
        self._open, self._tool = None, None
        self._blocks += 1
        return out


def _is_json(text: str) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True
