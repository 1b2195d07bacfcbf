"""The completion endpoints the proxy records, and vLLM's answers on chat and completions (0.32, see
tests/data/vllm_wire/): reading each choice's tokens out of a response or its stream chunks, and
removing what the client did not ask for. The Responses API's answers are read in responses.py;
the Anthropic Messages API goes to vLLM as a chat call (messages.py, messages_answer.py).

`ENDPOINTS` is the one table of them (an `Endpoint`: a completion API's path and wire shape): the
edge (which answers their routes entirely) and the forwarder read it.

- chat: `prompt_token_ids` at the top level (first chunk when streaming), `choices[i].token_ids`,
  logprobs in `choices[i].logprobs.content[].logprob`;
- completions: `prompt_token_ids` and `token_ids` per choice, logprobs in
  `choices[i].logprobs.token_logprobs`; choice index = prompt index * n + sample index;
- anything not requested is present as `null` (both modes), so stripping sets `null`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible completion API, forwarded to vLLM and recorded."""

    name: str  # recorded as transition.route, and the metrics' `route` label
    path: str  # the path on the proxy
    prompt_key: str  # the request field holding the prompt (recorded by message digest)
    upstream: str | None = None  # the path on vLLM, when not the same

    @property
    def upstream_path(self) -> str:
        return self.upstream or self.path

    @property
    def chat_answers(self) -> bool:
        """vLLM answers it as a chat completion."""
        return self.upstream_path == "/v1/chat/completions"


CHAT = Endpoint("chat", "/v1/chat/completions", "messages")
COMPLETIONS = Endpoint("completions", "/v1/completions", "prompt")
RESPONSES = Endpoint("responses", "/v1/responses", "input")  # `instructions` is recorded with it
# Anthropic's, sent to vLLM as a chat call (messages.py); `system` is recorded with the prompt
MESSAGES = Endpoint("messages", "/v1/messages", "messages", upstream=CHAT.path)
ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)


@dataclass
class Choice:
    """What one choice produced, accumulated from a response or from stream chunks."""

    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None


def collect(endpoint: Endpoint, data: dict[str, Any]) -> dict[int, Choice]:
    collected: dict[int, Choice] = {}
    prompt_ids = data.get("prompt_token_ids")  # chat: once per response
    for c in data.get("choices") or ():
        choice = collected.setdefault(c.get("index", 0), Choice())
        choice.prompt_token_ids = c.get("prompt_token_ids") or prompt_ids
        choice.token_ids = list(c.get("token_ids") or ())
        choice.finish_reason = c.get("finish_reason")
        if endpoint.chat_answers:
            message = c.get("message") or {}
            choice.text.append(message.get("content") or "")
            for i, tool_call in enumerate(message.get("tool_calls") or ()):
                choice.tool_calls[i] = tool_call
            content = (c.get("logprobs") or {}).get("content") or ()
            choice.logprobs = [entry["logprob"] for entry in content]
        else:
            choice.text.append(c.get("text") or "")
            choice.logprobs = list((c.get("logprobs") or {}).get("token_logprobs") or ())
    return collected


def collect_chunk(endpoint: Endpoint, chunk: dict[str, Any], collected: dict[int, Choice]) -> None:
    prompt_ids = chunk.get("prompt_token_ids")  # chat: in the first chunk only
    for c in chunk.get("choices") or ():
        choice = collected.setdefault(c.get("index", 0), Choice())
        if choice.prompt_token_ids is None:
            choice.prompt_token_ids = c.get("prompt_token_ids") or prompt_ids
        choice.token_ids.extend(c.get("token_ids") or ())
        if c.get("finish_reason") is not None:
            choice.finish_reason = c["finish_reason"]
        if endpoint.chat_answers:
            delta = c.get("delta") or {}
            if delta.get("content"):
                choice.text.append(delta["content"])
            for tc in delta.get("tool_calls") or ():
                merge_tool_call(choice.tool_calls, tc)
            content = (c.get("logprobs") or {}).get("content") or ()
            choice.logprobs.extend(entry["logprob"] for entry in content)
        else:
            choice.text.append(c.get("text") or "")
            choice.logprobs.extend((c.get("logprobs") or {}).get("token_logprobs") or ())


def merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    current = calls.setdefault(
        delta.get("index", 0),
        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
    )
    if delta.get("id"):
        current["id"] = delta["id"]
    if delta.get("type"):
        current["type"] = delta["type"]
    function = delta.get("function") or {}
    if function.get("name"):
        current["function"]["name"] += function["name"]
    if function.get("arguments"):
        current["function"]["arguments"] += function["arguments"]


def strip(data: dict[str, Any], *, token_ids: bool, logprobs: bool) -> None:
    """Undo what the proxy added to the request, in place, the way vLLM itself leaves it out."""
    if not token_ids and "prompt_token_ids" in data:
        data["prompt_token_ids"] = None
    for c in data.get("choices") or ():
        if not token_ids:
            for key in ("token_ids", "prompt_token_ids"):
                if key in c:
                    c[key] = None
        if not logprobs and "logprobs" in c:
            c["logprobs"] = None


def prompts(prompt: Any) -> list[Any]:
    """A completions `prompt` as a list of single prompts (str, or list of token ids)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return prompt
    return [prompt] if prompt is not None else []


def prompt_count(body: dict[str, Any]) -> int:
    return max(1, len(prompts(body.get("prompt"))))
