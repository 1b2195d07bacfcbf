"""The Anthropic Messages API (`POST /v1/messages`), the request side: what the proxy refuses, and
the chat completions request it sends vLLM instead.

vLLM 0.32 serves `/v1/messages` itself, by turning the request into a chat completions request
(vllm/entrypoints/anthropic/serving.py, `to_chat_completion_request`), but its Messages answers
carry no token ids and no logprobs, which every recorded call needs. So the proxy makes that same
conversion here and sends the chat request to vLLM's `/v1/chat/completions` with
`return_token_ids` and `logprobs`, as a chat call; messages_answer.py turns the chat answer back
into Anthropic's shape. The conversion follows vLLM's, field for field, so the prompt the model
sees (and its token ids) is the one vLLM's own `/v1/messages` would render:

- `system` (a string, or text blocks joined) becomes the first, system, message;
- a message's blocks: `text` and `image` (base64 or url) become content parts (one text part
  alone: a plain string), `thinking` the assistant's `reasoning`, `tool_use` a tool call (its
  `input` as `json.dumps` writes it), a user's `tool_result` a `tool` message placed before what
  is left of that user message (dropped if nothing is);
- `tools` (`input_schema`) become function tools (`tool_choice` "auto" unless given);
  `tool_choice` auto/any/tool/none becomes auto/required/named/none, and its
  `disable_parallel_tool_use` `parallel_tool_calls`;
- `max_tokens`, `stop_sequences` (as `stop`), `temperature`, `top_p`, `top_k` go as they are;
  `thinking` and `output_config` as vLLM maps them; `metadata` is recorded, not sent.
  (These fields are core/anthropic.py's `sent_fields`: the trainer reads a Messages call's
  sampling from them too.)
"""

from __future__ import annotations

import json
from typing import Any

from core import anthropic
from proxy.errors import ApiError

ROLES = ("user", "assistant", "system")  # vLLM also takes a system message among them
# The content blocks taken (vLLM's, but its tool search's tool_addition, tool_removal and
# tool_reference), and the types of their fields, as vLLM's request model checks them.
BLOCKS = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
BLOCK_FIELDS: dict[str, Any] = {"source": dict, "input": dict, "content": (str, list)}
BLOCK_FIELDS |= dict.fromkeys(("text", "id", "tool_use_id", "name", "thinking", "data"), str)
BILLING = "x-anthropic-billing-header"  # Claude Code's per-request line, skipped as vLLM does


def check(body: dict[str, Any]) -> None:
    """What the proxy refuses before anything goes upstream (400s, Anthropic-shaped at the edge):
    what vLLM's own request model would refuse, found before the conversion trips on it."""
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(
            400, "`max_tokens` is required and must be a positive integer", param="max_tokens"
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` is required and must be a non-empty list", param="messages")
    for n, message in enumerate(messages):
        where = f"messages[{n}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(
                400, f"{where} must be an object with `role` user or assistant", param=where
            )
        _check_content(message.get("content"), f"{where}.content")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_content(system, "system")
    stops = body.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(s, str) for s in stops)
    ):
        raise ApiError(400, "`stop_sequences` must be a list of strings", param="stop_sequences")
    for key, kinds in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", (int,))):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ApiError(400, f"`{key}` must be a number", param=key)
    for key in ("metadata", "thinking", "output_config"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise ApiError(400, f"`{key}` must be an object", param=key)
    _check_tools(body.get("tools"), body.get("tool_choice"))


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ApiError(400, f"`{where}` must be a string or a list of content blocks", param=where)
    for n, block in enumerate(content):
        at = f"{where}[{n}]"
        if not isinstance(block, dict) or block.get("type") not in BLOCKS:
            kinds = ", ".join(BLOCKS)
            raise ApiError(400, f"`{at}` must be a content block of type {kinds}", param=at)
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise ApiError(400, f"`{at}.text` must be a string", param=f"{at}.text")
        for key, kinds in BLOCK_FIELDS.items():
            value = block.get(key)
            if value is not None and not isinstance(value, kinds):
                raise ApiError(400, f"`{at}.{key}` is of the wrong type", param=f"{at}.{key}")
        items = block.get("content")
        if isinstance(items, list) and not all(isinstance(i, dict) for i in items):
            raise ApiError(400, f"`{at}.content` must hold blocks", param=f"{at}.content")


def _check_tools(tools: Any, tool_choice: Any) -> None:
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError(400, "`tools` must be a list", param="tools")
        for n, tool in enumerate(tools):
            if not (isinstance(tool, dict) and isinstance(tool.get("name"), str)):
                raise ApiError(
                    400, f"`tools[{n}]` must be an object with a `name`", param=f"tools[{n}]"
                )
            if not isinstance(tool.get("input_schema"), dict):
                raise ApiError(
                    400,
                    f"`tools[{n}].input_schema` must be a JSON schema object (only custom tools "
                    "are served: vLLM runs no server tools)",
                    param=f"tools[{n}].input_schema",
                )
    if tool_choice is None:
        return
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else None
    if kind not in anthropic.TOOL_CHOICES and kind != "tool":
        raise ApiError(
            400, "`tool_choice.type` must be auto, any, tool or none", param="tool_choice"
        )
    if kind == "tool" and not isinstance(tool_choice.get("name"), str):
        raise ApiError(400, "`tool_choice` of type tool needs a `name`", param="tool_choice.name")


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request vLLM's /v1/messages would make of this one (model aside)."""
    out: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for message in body["messages"]:
        _convert_message(message, out)
    chat: dict[str, Any] = {"messages": out} | anthropic.sent_fields(body)
    if body.get("stream"):
        chat["stream"] = True
    return chat


def prompt_messages(body: dict[str, Any]) -> list[Any]:
    """The prompt as recorded: `system` as a system message, then the messages as sent."""
    system = body.get("system")
    head = [{"role": "system", "content": system}] if system else []
    return head + list(body.get("messages") or ())


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    parts = [
        b["text"]
        for b in system or ()
        if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING)
    ]
    return "".join(parts)


def _convert_message(message: dict[str, Any], out: list[dict[str, Any]]) -> None:
    role, content = message["role"], message.get("content")
    if role == "system":
        text = _system_text(content)
        if text and not text.startswith(BILLING):
            out.append({"role": "system", "content": text})
        return
    chat: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        chat["content"] = content
    else:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content or ():
            _convert_block(block, role, parts, calls, reasoning, out)
        if reasoning:
            chat["reasoning"] = "".join(reasoning)
        if calls:
            chat["tool_calls"] = calls
        if len(parts) == 1 and parts[0]["type"] == "text":
            chat["content"] = parts[0]["text"]
        elif parts:
            chat["content"] = parts
    if not (role == "user" and "content" not in chat):
        out.append(chat)


def _convert_block(
    block: dict[str, Any],
    role: str,
    parts: list[dict[str, Any]],
    calls: list[dict[str, Any]],
    reasoning: list[str],
    out: list[dict[str, Any]],
) -> None:
    kind = block["type"]
    if kind == "text" and block.get("text"):
        parts.append({"type": "text", "text": block["text"]})
    elif kind == "image" and block.get("source"):
        parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
    elif kind == "thinking" and isinstance(block.get("thinking"), str):
        reasoning.append(block["thinking"])
    elif kind == "tool_use":
        arguments = json.dumps(block.get("input") or {})  # vLLM's json.dumps, spaces and all
        calls.append(
            {
                "id": block.get("id") or "call_0",
                "type": "function",
                "function": {"name": block.get("name") or "", "arguments": arguments},
            }
        )
    elif kind == "tool_result" and role == "user":
        _tool_result(block, out)
    elif kind == "tool_result":
        text = str(block.get("content")) if block.get("content") else ""
        parts.append({"type": "text", "text": f"Tool result: {text}"})


def _tool_result(block: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """A user's tool result: a `tool` message (its images after it, as a user message)."""
    content, text, images = block.get("content"), "", []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        items = [item for item in content if isinstance(item, dict)]
        texts = [item.get("text") for item in items if item.get("type") == "text"]
        text = "\n".join(t for t in texts if isinstance(t, str))
        images = [
            _image_url(item.get("source") or {}) for item in items if item.get("type") == "image"
        ]
    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text})
    if images:
        out.append(
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": u}} for u in images],
            }
        )


def _image_url(source: Any) -> str:
    if not isinstance(source, dict):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
