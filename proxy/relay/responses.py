"""The Responses API (`POST /v1/responses`) as vLLM 0.32 serves it (see
tests/data/vllm_wire/responses_*): what the proxy asks vLLM for, how it reads the one model call
out of the answer, and how it removes again what the client did not ask for.

- **Token ids**: `enable_response_messages: true` makes vLLM return `input_messages` and
  `output_messages`, each `[{"message", "tokens", "type": "raw_message_tokens"}]`: the rendered
  prompt's ids and the sampled ids (end token included). Streaming: only in the terminal event's
  `response`; the other events carry them as `null`.
- **Logprobs**: `include: ["message.output_text.logprobs"]` puts one entry per sampled token in
  `output[].content[].logprobs` of the output_text part (and in each `output_text.delta` event).
  vLLM drops them when the output is only a function call (no output_text to hang them on): such
  a record has ids but no logprobs.
- Not asked for, vLLM sends `input_messages`/`output_messages`/`top_logprobs` as `null`,
  `output_text.delta`'s logprobs as `[]` and a finished part's logprobs as `null`: stripping
  restores exactly that.
- A stream is `event: <type>\\ndata: <json>\\n\\n` events, no `[DONE]`; it ends with
  `response.completed` (also when cut at `max_output_tokens`: `status: "incomplete"`),
  `response.incomplete` or `response.failed`, or an `error` event.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import ApiError
from proxy.relay.wire import Choice

LOGPROBS = "message.output_text.logprobs"
TERMINAL = {"response.completed": "ok", "response.incomplete": "ok", "response.failed": "failed"}


def check(body: dict[str, Any]) -> None:
    """What the proxy refuses before anything goes upstream."""
    if body.get("background"):
        raise ApiError(
            400,
            "`background` responses are not supported through Flywheel: vLLM returns no token "
            "ids for them, so they could not be recorded. Send the request without `background`.",
            param="background",
        )
    items = body.get("input")
    if isinstance(items, list) and body.get("previous_response_id") is None:
        _check_call_outputs(items)
    include = body.get("include")
    if include is not None and not (
        isinstance(include, list) and all(isinstance(i, str) for i in include)
    ):
        raise ApiError(400, "`include` must be a list of strings", param="include")


def _check_call_outputs(items: list[Any]) -> None:
    """A tool's result must answer a call in the same input, as OpenAI requires (vLLM does not
    check: it would render the orphan result and the transition would train on it). With
    `previous_response_id` the call may be in the stored response, so nothing is checked."""
    calls = set()
    for n, item in enumerate(items):
        if not isinstance(item, dict):
            continue  # vLLM's own validation answers
        if item.get("type") == "function_call":
            calls.add(item.get("call_id"))
        elif item.get("type") == "function_call_output" and item.get("call_id") not in calls:
            raise ApiError(
                400,
                f"No tool call found for function call output with call_id "
                f"{item.get('call_id')!r} (input[{n}]): send the `function_call` item before its "
                "output, or chain with `previous_response_id`.",
                param=f"input[{n}].call_id",
            )


def wants(body: dict[str, Any]) -> tuple[bool, bool]:
    """(token ids, logprobs): what the client itself asked for."""
    return bool(body.get("enable_response_messages")), LOGPROBS in (body.get("include") or ())


def upstream_body(body: dict[str, Any]) -> dict[str, Any]:
    include = body.get("include") or []
    return {
        **body,
        "enable_response_messages": True,
        "include": include if LOGPROBS in include else [*include, LOGPROBS],
    }


def read(response: dict[str, Any], into: Choice) -> None:
    """Fill `into` from a finished response object (the body, or a terminal event's `response`)."""
    inputs, outputs = response.get("input_messages"), response.get("output_messages")
    # One rendered prompt and one sampled output: a single model call. vLLM's built-in tools
    # (a tool server) run several calls in one response; those are not split into transitions.
    if isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == 1:
        into.prompt_token_ids = list(inputs[0].get("tokens") or ()) or None
        into.token_ids = [t for m in outputs for t in m.get("tokens") or ()]
    into.text, into.logprobs, calls = [], [], []
    for item in response.get("output") or ():
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or ():
                if part.get("type") == "output_text":
                    into.text.append(part.get("text") or "")
                    into.logprobs.extend(e["logprob"] for e in part.get("logprobs") or ())
        elif kind == "function_call":
            calls.append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
            )
    into.tool_calls = dict(enumerate(calls))
    into.finish_reason = finish_reason(response, bool(calls))


def finish_reason(response: dict[str, Any], called: bool) -> str:
    """The chat-style finish reason of a response: what the trainer and the episode view read."""
    status = response.get("status")
    if status == "incomplete":
        reason = (response.get("incomplete_details") or {}).get("reason")
        return "length" if reason == "max_output_tokens" else str(reason or "incomplete")
    if status in ("failed", "cancelled"):
        return str(status)
    return "tool_calls" if called else "stop"


def read_event(event: dict[str, Any], into: Choice) -> str | None:
    """Collect one stream event; the call's status ("ok" / "failed") once the stream is over."""
    kind = event.get("type")
    if kind == "response.output_text.delta":
        into.text.append(event.get("delta") or "")  # kept if the stream ends early
        return None
    if kind in TERMINAL:
        read(event.get("response") or {}, into)
        return TERMINAL[kind]
    if kind == "error":
        return "failed"
    return None


def strip(response: dict[str, Any], *, token_ids: bool, logprobs: bool) -> None:
    """Remove from a response object, in place, what the proxy added to the request."""
    if not token_ids:
        if "input_messages" in response:
            response["input_messages"] = None
        if "output_messages" in response:
            response["output_messages"] = None
    if not logprobs:
        if "top_logprobs" in response:
            response["top_logprobs"] = None
        for item in response.get("output") or ():
            _strip_item(item)


def strip_event(event: dict[str, Any], *, token_ids: bool, logprobs: bool) -> None:
    if isinstance(inner := event.get("response"), dict):
        strip(inner, token_ids=token_ids, logprobs=logprobs)
    if logprobs:
        return
    kind = event.get("type")
    if kind in ("response.output_text.delta", "response.output_text.done"):
        event["logprobs"] = []
    elif isinstance(part := event.get("part"), dict) and kind == "response.content_part.done":
        if part.get("type") == "output_text":
            part["logprobs"] = None
    elif isinstance(item := event.get("item"), dict):
        _strip_item(item)


def _strip_item(item: dict[str, Any]) -> None:
    for part in item.get("content") or ():
        if isinstance(part, dict) and part.get("type") == "output_text" and "logprobs" in part:
            part["logprobs"] = None


def prompt_messages(body: dict[str, Any]) -> list[Any]:
    """The prompt as recorded: `instructions` as a system message, then the input items (a
    string input is one user message). With `previous_response_id`, only the new items: the
    prompt's token ids, from vLLM, are still the whole prompt."""
    messages: list[Any] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        messages.extend(items)
    return messages


def error_of(event: dict[str, Any]) -> dict[str, Any]:
    """The error a failed stream ended with, shaped as an error body."""
    if event.get("type") == "error":
        return {"error": {k: event.get(k) for k in ("message", "type", "code", "param")}}
    return {"error": (event.get("response") or {}).get("error")}


def unknown_previous(body: dict[str, Any], status: int, payload: bytes) -> bytes | None:
    """vLLM's 404 for a `previous_response_id` it does not keep, as an error that says why."""
    previous = body.get("previous_response_id")
    if status != 404 or not isinstance(previous, str):
        return None
    try:
        error = orjson.loads(payload).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if error.get("param") != "response_id":
        return None
    message = (
        f"previous_response_id {previous!r} is not known to vLLM. vLLM keeps responses only "
        "when started with VLLM_ENABLE_RESPONSES_API_STORE=1, in the memory of the replica "
        "that answered (lost when it restarts), and not those sent with `store: false`. "
        "Send the conversation so far as `input` instead."
    )
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": "response_not_found",
            }
        }
    )
