"""Synthetic traffic as the proxy records it: multi-turn agent episodes as `TransitionRecord`s,
for the store's tests and the recording benchmarks (bench/recording_rate.py); one-call prompts of
every shape the routes record, for the writer's prompt memo (bench/memo_soak.py).

Each call's prompt repeats the whole history so far (a long system prompt, growing messages,
prompt token ids growing with them); completions carry ids and logprobs.
"""

from __future__ import annotations

import base64
import random
import time
import uuid
from typing import Any

import orjson

from core import codecs
from core.record import TransitionRecord

SYSTEM = "You are a careful assistant that uses tools. " * 25  # ~1.1 kB, shared by every call


def episode_records(rng: random.Random, turns: int) -> list[TransitionRecord]:
    """One agent episode: each call's prompt repeats the whole history so far."""
    episode_id, task_id = f"bench-{uuid.uuid4().hex[:12]}", f"task-{rng.randrange(1000)}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    prompt_ids = [rng.randrange(50_000) for _ in range(300)]
    records = []
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": f"step {turn}: " + "data " * 40}]
        completion = [rng.randrange(50_000) for _ in range(100)]
        records.append(
            TransitionRecord(
                id=str(uuid.uuid4()),
                episode_id=episode_id,
                request_id=str(uuid.uuid4()),
                choice_index=0,
                task_id=task_id,
                agent_name="bench",
                requested_at=time.time(),
                route="chat",
                status="ok",
                http_status=200,
                model_requested="policy",
                model_used="base",
                policy_version=0,
                messages=orjson.loads(orjson.dumps(messages)),  # parsed afresh per call
                params={"model": "policy", "max_tokens": 128},
                prompt_token_ids=prompt_ids,
                completion_token_ids=completion,
                logprobs=[-rng.random() for _ in completion],
                text="ok " * 60,
                tool_calls=None,
                finish_reason="stop",
                latency_ms=50.0,
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(completion),
            )
        )
        messages = [*messages, {"role": "assistant", "content": "ok " * 60}]
        prompt_ids = prompt_ids + completion + [rng.randrange(50_000) for _ in range(60)]
    return records


# A call's prompt as core/record.py keeps it, by route and content: chat with string content,
# chat with list content and an image, a completions prompt, a Responses input of typed items,
# a short chat prompt.
PROMPT_SHAPES = ("chat", "image", "completions", "responses", "short")


def one_call_prompt(
    shape: str, rng: random.Random, n: int, tokens: int = 600
) -> tuple[list[Any], list[int]]:
    """Call `n`'s recorded messages (parsed afresh from JSON, as the proxy parses a request;
    unique text per call) and its prompt token ids (`tokens`; a short prompt has 12)."""
    words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(60))
    messages: list[Any]
    if shape == "chat":
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"call {n}: {words}"},
        ]
    elif shape == "image":
        image = base64.b64encode(rng.randbytes(6000)).decode()
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"call {n}: {words}"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                ],
            }
        ]
    elif shape == "completions":
        messages = [{"prompt": f"{SYSTEM}\ncall {n}: {words}"}]
    elif shape == "responses":
        messages = [
            {"role": "system", "content": SYSTEM},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]},
        ]
    else:
        messages, tokens = [{"role": "user", "content": f"hi {n}"}], 12
    return orjson.loads(orjson.dumps(messages)), [rng.randrange(150_000) for _ in range(tokens)]


def through_memo(
    memo: codecs.PromptMemo, episode_id: str, messages: list[Any], ids: list[int]
) -> tuple[list[bytes], list[bytes]]:
    """What the writer's store does with one call's prompt (proxy/record/store/transitions.py):
    (message digests, token block digests)."""
    digests = memo.message_digests(episode_id, messages)
    packed = codecs.pack(ids, "i")
    blocks, _, _ = codecs.split_blocks(packed, known=memo.known_blocks(episode_id))
    memo.remember(episode_id, messages, digests, packed, blocks)
    return digests, blocks
