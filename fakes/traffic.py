"""Synthetic traffic as the proxy records it: multi-turn agent episodes as `TransitionRecord`s,
for the store's tests and the recording benchmarks (bench/recording_rate.py).

Each call's prompt repeats the whole history so far (a long system prompt, growing messages,
prompt token ids growing with them); completions carry ids and logprobs.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import orjson

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
