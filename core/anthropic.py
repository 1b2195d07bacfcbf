"""What an Anthropic Messages request asks of vLLM's sampler: the chat completions fields vLLM's
`/v1/messages` would send for it (vllm/entrypoints/anthropic/serving.py,
`to_chat_completion_request`), messages aside.

One mapping for both sides: the proxy sends these with the converted messages
(proxy/relay/messages.py `chat_request`), and the trainer reads a recorded Messages call's
sampling from them (trainer/data/sampling.py), since the call's `params` keep the Anthropic body as
posted: `output_config.format` is a grammar vLLM applied, `thinking.budget_tokens` a thinking
budget, `tool_choice` `{"type": "auto"}` plain sampling, and fields the conversion drops
(`min_p`, `logit_bias`, `repetition_penalty`) were never applied.
"""

from __future__ import annotations

from typing import Any

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": a named one
# (Anthropic's field, the chat request's): sent when given
SAMPLING = (("stop_sequences", "stop"), ("temperature",) * 2, ("top_p",) * 2, ("top_k",) * 2)


def sent_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request's fields for this Messages request, but its messages and `stream`.
    `body` is a request the proxy accepted (proxy/relay/messages.py `check`); a recorded one
    that is not raises (KeyError, TypeError, AttributeError)."""
    chat: dict[str, Any] = {"max_tokens": body["max_tokens"]}
    chat["max_completion_tokens"] = body["max_tokens"]
    for key, chat_key in SAMPLING:
        if body.get(key) is not None:
            chat[chat_key] = body[key]
    _thinking_and_output(body, chat)
    tool_choice = body.get("tool_choice")
    if tool_choice is not None:
        chat["parallel_tool_calls"] = not tool_choice.get("disable_parallel_tool_use", False)
        kind = tool_choice["type"]
        chat["tool_choice"] = TOOL_CHOICES.get(kind) or {
            "type": "function",
            "function": {"name": tool_choice["name"]},
        }
    if body.get("tools") is not None:
        chat["tools"] = [_function(tool) for tool in body["tools"]]
        chat.setdefault("tool_choice", "auto")
    return chat


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    for key in ("description", "strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _thinking_and_output(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """`thinking` and `output_config`, as vLLM maps them (a disabled thinking: effort "none")."""
    thinking = body.get("thinking") or {}
    if thinking.get("type") == "disabled":
        chat["reasoning_effort"] = "none"
    elif thinking.get("type") == "enabled" and thinking.get("budget_tokens") is not None:
        chat["thinking_token_budget"] = thinking["budget_tokens"]
    output = body.get("output_config") or {}
    form = output.get("format") or {}
    if isinstance(form, dict) and form.get("json_schema"):
        chat["response_format"] = {
            "type": form.get("type"),
            "json_schema": {"name": form.get("type"), "schema": form["json_schema"]},
        }
    if output.get("effort") is not None:
        chat["reasoning_effort"] = output["effort"]
