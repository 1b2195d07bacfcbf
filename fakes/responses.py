"""The fake vLLM's `POST /v1/responses` (fakes/vllm.py serves it): vLLM 0.32's Responses API as
captured in tests/data/vllm_wire/responses_*, with the same deterministic completions as chat.

Like the vLLM it imitates, it keeps no responses unless `store_responses` is on (vLLM's
`VLLM_ENABLE_RESPONSES_API_STORE=1`): an unknown `previous_response_id` gets 404 and `background` a
400. A stored response is only remembered by id (what routing needs), not replayed into the prompt.
A tool call comes back under the same rule as chat: `tool_choice` names a function or is
"required", or the input says "call a tool" and does not end with a tool's result.
"""

import asyncio
import time
from typing import Any

from aiohttp import web

from fakes import engine

Json = dict[str, Any]
LOGPROBS = "message.output_text.logprobs"
BACKGROUND = (
    "This vLLM engine does not support `store=True` and therefore does not support the "
    "background mode. To enable these features, set the environment variable "
    "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server."
)


def rendered(body: Json) -> str:
    """The prompt as text, roughly as the chat template renders it (only its tokens matter)."""
    parts = []
    if body.get("instructions"):
        parts.append(f"<|im_start|>system {body['instructions']}")
    items = body["input"]
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items:
        text = item.get("content") or item.get("output") or item.get("arguments") or ""
        parts.append(f"<|im_start|>{item.get('role', item.get('type'))} {text}")
    return " ".join(parts) + " <|im_start|>assistant"


def as_chat(body: Json) -> Json:
    """The request in chat's shape, to reuse the chat fake's tool-call rule."""
    tools = [{"type": "function", "function": t} for t in body.get("tools") or ()]
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    messages = [{"role": "user", "content": rendered(body)}]
    items = body["input"]
    if isinstance(items, list) and items and items[-1].get("type") == "function_call_output":
        messages.append({"role": "tool", "content": items[-1].get("output")})
    return {"tools": tools, "tool_choice": choice, "messages": messages}


def validate(body: Json, served: list[str], stored: set[str]) -> web.Response | None:
    items = body.get("input")
    if not isinstance(items, str | list):
        errors = [
            f"{{'type': '{kind}_type', 'loc': 'body.input', 'msg': 'Input should be a valid "
            f"{kind}', 'input': '{items}'}}"
            for kind in ("string", "list")
        ]
        msg = "2 validation errors:\n  " + "\n  ".join(errors)
        return engine.error(400, msg, "Bad Request", "body.input")
    model = body.get("model") or served[0]
    if model not in served:
        msg = f"The model `{model}` does not exist. Valid aliases: {served[0]}."
        return engine.error(404, msg, "NotFoundError", "model")
    if body.get("background"):
        return engine.error(400, BACKGROUND, "invalid_request_error", "background")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):  # vLLM's pydantic validation
        msg = "1 validation error:\n  {'type': 'string_type', 'loc': 'body.previous_response_id', "
        msg += "'msg': 'Input should be a valid string'}"
        return engine.error(400, msg, "Bad Request", "body.previous_response_id")
    if previous is not None and previous not in stored:
        msg = f"Response with id '{previous}' not found."
        return engine.error(404, msg, "invalid_request_error", "response_id")
    return None


def tool_echo(tool: Json) -> Json:
    return {
        "name": tool.get("name"),
        "parameters": tool.get("parameters"),
        "strict": None,
        "type": "function",
        "allowed_callers": None,
        "defer_loading": None,
        "description": tool.get("description"),
        "output_schema": None,
    }


def usage(prompt_tokens: int, output_tokens: int) -> Json:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt_tokens + output_tokens,
    }


def logprob_entries(tokens: list[engine.Token], *, final: bool) -> list[Json]:
    """Per token: {token, bytes, logprob, top_logprobs} in a finished part; no bytes in deltas."""
    out = []
    for t in tokens:
        text = t.text or engine.EOS_TEXT
        entry: Json = {"token": text}
        if final:
            entry["bytes"] = list(text.encode())
        out.append({**entry, "logprob": t.logprob, "top_logprobs": []})
    return out


def output_items(choice: engine.Choice, item_id: str, want_logprobs: bool) -> list[Json]:
    if choice.tool_call:
        call = choice.tool_call
        return [
            {
                "arguments": call["arguments"],
                "call_id": call["id"],
                "name": call["name"],
                "type": "function_call",
                "id": item_id,
                "caller": None,
                "namespace": None,
                "status": "completed",
            }
        ]
    text = "".join(t.text for t in choice.tokens)
    logprobs = logprob_entries(choice.tokens, final=True) if want_logprobs else None
    part = {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}
    return [
        {
            "id": item_id,
            "content": [part],
            "role": "assistant",
            "status": "completed",
            "type": "message",
            "phase": None,
        }
    ]


def response_object(
    body: Json,
    model: str,
    *,
    status: str,
    output: list[Json],
    choice: engine.Choice | None,
    prompt_ids: list[int],
    response_id: str,
    created: int,
) -> Json:
    want_ids, want_logprobs = bool(body.get("enable_response_messages")), wants_logprobs(body)
    tokens = choice.tokens if choice is not None else []  # none yet: the stream's first events
    incomplete = choice is not None and choice.finish_reason == "length"
    tool_choice = body.get("tool_choice") or ("auto" if body.get("tools") else "none")
    raw = want_ids and choice is not None
    return {
        "id": response_id,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "metadata": None,
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "temperature": body.get("temperature", 1.0),
        "tool_choice": tool_choice,
        "tools": [tool_echo(t) for t in body.get("tools") or ()],
        "top_p": 1.0,
        "background": False,
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "previous_response_id": None,
        "prompt": None,
        "reasoning": None,
        "service_tier": "auto",
        "status": "incomplete" if incomplete else status,
        "text": None,
        "top_logprobs": body.get("top_logprobs", 0) if want_logprobs else None,
        "truncation": "disabled",
        "usage": usage(len(prompt_ids), len(tokens)) if choice is not None else None,
        "user": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": [
            {"message": rendered(body), "tokens": prompt_ids, "type": "raw_message_tokens"}
        ]
        if raw
        else None,
        "output_messages": [
            {
                "message": "".join(t.text for t in tokens),
                "tokens": [t.id for t in tokens],
                "type": "raw_message_tokens",
            }
        ]
        if raw
        else None,
    }


def wants_logprobs(body: Json) -> bool:
    return LOGPROBS in (body.get("include") or ())


def with_detail(body: Json) -> Json:
    """The fake's `always_detail` (benchmarks): ids and logprobs whether asked or not."""
    include = [*(body.get("include") or ()), LOGPROBS]
    return {**body, "enable_response_messages": True, "include": include}


async def responses(state: engine.FakeState, body: Json, request: web.Request) -> Any:
    if (invalid := validate(body, engine.served_names(state), state.stored)) is not None:
        return invalid
    if state.always_detail:
        body = with_detail(body)
    model = body.get("model") or state.model
    prompt_ids = engine.tokenize(rendered(body))
    key = f"{model}|{prompt_ids}|0|{body.get('seed')}"
    max_tokens = body.get("max_output_tokens") or 16
    choice = engine.tool_choice_for(as_chat(body), key) or engine.sample(key, max_tokens)
    if len(state.sampled) > 10_000:  # a benchmark's worth
        state.sampled.clear()
    state.sampled[(*prompt_ids, *(t.id for t in choice.tokens))] = [
        t.logprob for t in choice.tokens
    ]
    response_id, created = f"resp_{engine.new_id('x')[2:]}", int(time.time())
    if state.store_responses and body.get("store", True) is not False:
        state.stored.add(response_id)
    item_id = ("fc_" if choice.tool_call else "msg_") + engine.new_id("x")[2:]
    output = output_items(choice, item_id, wants_logprobs(body))
    ids: Any = {"prompt_ids": prompt_ids, "response_id": response_id, "created": created}
    final = response_object(body, model, status="completed", output=output, choice=choice, **ids)
    if not body.get("stream"):
        return web.json_response(final, dumps=engine.compact)
    start = response_object(body, model, status="in_progress", output=[], choice=None, **ids)
    events: list[Json] = [
        {"response": start, "type": "response.created"},
        {"response": start, "type": "response.in_progress"},
        *(
            call_events(choice, output[0])
            if choice.tool_call
            else text_events(choice, output[0], wants_logprobs(body))
        ),
        {"item": output[0], "output_index": 0, "type": "response.output_item.done"},
        {"response": final, "type": "response.completed"},
    ]
    response = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    for number, event in enumerate(events):
        if state.token_delay_s:
            await asyncio.sleep(state.token_delay_s)
        event = dict(sorted({**event, "sequence_number": number}.items()))  # vLLM's order
        await response.write(f"event: {event['type']}\ndata: {engine.compact(event)}\n\n".encode())
    if state.end_delay_s:
        await asyncio.sleep(state.end_delay_s)
    await response.write_eof()
    return response


def text_events(choice: engine.Choice, item: Json, want_logprobs: bool) -> list[Json]:
    where = {"content_index": 0, "item_id": item["id"], "output_index": 0}
    text = item["content"][0]["text"]
    added = {**item, "content": [], "status": "in_progress"}
    events: list[Json] = [
        {"item": added, "output_index": 0, "type": "response.output_item.added"},
        {
            **where,
            "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []},
            "type": "response.content_part.added",
        },
    ]
    for token in (t for t in choice.tokens if t.text):
        logprobs = logprob_entries([token], final=False) if want_logprobs else []
        events.append(
            {
                "content_index": 0,
                "delta": token.text,
                "item_id": item["id"],
                "logprobs": logprobs,
                "output_index": 0,
                "type": "response.output_text.delta",
            }
        )
    events.append({**where, "logprobs": [], "text": text, "type": "response.output_text.done"})
    events.append({**where, "part": item["content"][0], "type": "response.content_part.done"})
    return events


def call_events(choice: engine.Choice, item: Json) -> list[Json]:
    arguments = item["arguments"]
    added = {**item, "arguments": "", "status": "in_progress"}
    events: list[Json] = [{"item": added, "output_index": 0, "type": "response.output_item.added"}]
    for piece in (arguments[: len(arguments) // 2], arguments[len(arguments) // 2 :]):
        events.append(
            {
                "delta": piece,
                "item_id": item["id"],
                "output_index": 0,
                "type": "response.function_call_arguments.delta",
            }
        )
    events.append(
        {
            "arguments": arguments,
            "item_id": item["id"],
            "name": item["name"],
            "output_index": 0,
            "type": "response.function_call_arguments.done",
        }
    )
    return events
