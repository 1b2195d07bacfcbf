"""The fake vLLM's engine: what every API of it (chat, completions, responses) stands on.

Its state (the knobs, the adapters loaded, what it was sent and what it sampled), its tokenizer
and sampler, its tool-call rule and vLLM's error body. Completions are deterministic: token ids
and logprobs come from a pseudo-random stream seeded by the model name, the prompt, the choice
index and `seed`. A tool call comes back when the request has `tools` and either `tool_choice`
names a function or is "required", or the last user message says "call a tool" and no tool
result follows it. The server and its chat and completions routes are fakes/vllm.py; the
Responses API is fakes/responses.py.
"""

import asyncio
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

EOS_ID, EOS_TEXT = 2, "<|im_end|>"
VOCAB_SIZE = 731
WORDS = ["the", "a", "cat", "dog", "sun", "one", "two", "three", "is", "and", "of", "to"]
Json = dict[str, Any]


def token_text(token_id: int) -> str:
    return EOS_TEXT if token_id == EOS_ID else " " + WORDS[token_id % len(WORDS)]


def tokenize(text: str) -> list[int]:
    """One id per word or punctuation mark (roughly what byte-level BPE gives): stable and cheap."""
    pieces = re.findall(r"\s?\w+|\s?[^\w\s]|\s+", text)
    digests = (hashlib.blake2b(p.encode(), digest_size=4).digest() for p in pieces)
    return [3 + int.from_bytes(d) % (VOCAB_SIZE - 3) for d in digests] or [3]


def new_id(prefix: str) -> str:
    return f"{prefix}-{random.getrandbits(64):016x}"


@dataclass
class Token:
    id: int
    text: str  # what the token adds to the visible text ("" for the end-of-sequence token)
    logprob: float
    rng_state: int  # seeds this token's fake top-logprob alternatives


@dataclass
class Choice:
    tokens: list[Token]
    finish_reason: str
    tool_call: Json | None = None  # {"name", "arguments"} when this choice calls a tool


def sample(key: str, max_tokens: int) -> Choice:
    """A deterministic completion: 3-24 tokens and end-of-sequence, or cut at max_tokens."""
    rng = random.Random(key)
    natural = rng.randint(3, 24)
    tokens = []
    for i in range(min(natural + 1, max_tokens)):
        token_id = EOS_ID if i == natural else rng.randrange(3, VOCAB_SIZE)
        text = "" if token_id == EOS_ID else token_text(token_id)
        tokens.append(Token(token_id, text, -round(rng.uniform(0.05, 7.0), 6), rng.getrandbits(32)))
    return Choice(tokens, "stop" if natural < max_tokens else "length")


def tool_arguments(parameters: Json) -> Json:
    args: Json = {}
    for name, schema in parameters.get("properties", {}).items():
        kind = schema.get("type")
        if "enum" in schema:
            args[name] = schema["enum"][0]
        elif kind in ("integer", "number"):
            args[name] = 3
        elif kind == "boolean":
            args[name] = True
        else:
            args[name] = "Paris" if kind == "string" else None
    return args


def tool_choice_for(body: Json, key: str) -> Choice | None:
    """The tool call this request gets, Qwen/hermes style, or None."""
    tools, tool_choice = body.get("tools") or [], body.get("tool_choice", "auto")
    if not tools or tool_choice == "none":
        return None
    named = isinstance(tool_choice, dict)
    users = [m for m in body["messages"] if m.get("role") == "user"]
    answered = body["messages"][-1].get("role") == "tool"  # a tool's result came back: answer it
    asked = "call a tool" in str(users[-1:]).lower() and not answered
    wants = named or tool_choice == "required" or asked
    if not wants:
        return None
    name = tool_choice["function"]["name"] if named else tools[0]["function"]["name"]
    tool = next(t["function"] for t in tools if t["function"]["name"] == name)
    arguments = json.dumps(tool_arguments(tool.get("parameters") or {}))
    text = f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
    rng = random.Random(key)
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)] + [""]
    tokens = [
        Token(EOS_ID if not p else rng.randrange(3, VOCAB_SIZE), p, -round(rng.uniform(0, 1), 6), i)
        for i, p in enumerate(pieces)
    ]
    # vLLM: a named tool finishes with "stop", others with "tool_calls"; content is "" when the
    # call was forced by guided decoding (named, required) and null when the parser found it.
    finish = "stop" if named else "tool_calls"
    content = None if tool_choice == "auto" else ""
    call = {"id": new_id("chatcmpl-tool"), "name": name, "arguments": arguments, "content": content}
    return Choice(tokens, finish, call)


def error(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.json_response(body, status=status, dumps=compact)


def compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


@dataclass
class FakeState:
    model: str = "demo"
    latency_s: float = 0.0
    token_delay_s: float = 0.0
    # After a stream's last event, before its end (the chunked terminator): the end of a stream is
    # read apart from its last event, as from a busy vLLM or a slow network.
    end_delay_s: float = 0.0
    scoring_delay_s: float = 0.0  # before a `prompt_logprobs` answer (the proxy's scoring call)
    check_lora_paths: bool = True  # vLLM answers 404 when the adapter directory is missing
    max_lora_rank: int = 8  # vLLM's --max-lora-rank: larger adapters are refused with a 400
    load_delay_s: float = 0.0  # before each adapter load answers (a big adapter, a slow disk)
    loras: dict[str, str] = field(default_factory=dict)
    requests: list[Json] = field(default_factory=list)
    failures: list[tuple[int, Json]] = field(default_factory=list)
    log_path: str | None = None  # also append each request's path and model here (JSON lines)
    # Benchmarks: send token ids and sampled-token logprobs whether asked or not, so that the
    # fake does the same work for a direct caller as for the proxy (which always asks for them).
    always_detail: bool = False
    # What /v1/responses sampled (prompt + completion ids -> completion logprobs), so that
    # `prompt_logprobs` scores those tokens as sampled, as a real model does
    # (proxy/relay/scoring.py).
    sampled: dict[tuple[int, ...], list[float]] = field(default_factory=dict)
    # The content of the next non-streamed chat answers, one each (token ids stay generated).
    replies: list[str] = field(default_factory=list)
    # A request held to a JSON schema of `scores` (core/ruler.py) gets scores that fit it, as
    # vLLM's guided decoding would give (bench/judge.py).
    judge_answers: bool = False
    store_responses: bool = False  # vLLM's VLLM_ENABLE_RESPONSES_API_STORE: ids it answered
    # At most this many generations at once, the rest waiting their turn (vLLM's --max-num-seqs:
    # a full batch queues the next call); 0: no limit. `batch` is its semaphore, made on first use.
    max_running: int = 0
    batch: tuple[int, asyncio.Semaphore] | None = None
    stored: set[str] = field(default_factory=set)
    detokenized: list[list[int]] = field(default_factory=list)  # each /detokenize call's tokens

    def fail_next(self, n: int = 1, status: int = 500, body: Json | None = None) -> None:
        """Answer the next n requests (of any kind) with this status and error body."""
        body = body or {
            "error": {
                "message": "injected failure",
                "type": "InternalServerError",
                "param": None,
                "code": status,
            }
        }
        self.failures.extend([(status, body)] * n)


def served_names(state: FakeState) -> list[str]:
    return [state.model, *state.loras]
