"""The writer's prompt memo is bounded for real (issue 31, item 2): the bytes it accounts follow
what it holds, for every shape of prompt the routes record, its entries are capped, and a flood
of one-call episodes (calls without X-Episode-Id) does not push out the conversations going on.
The RSS soak is bench/memo_soak.py (a short run in tests/bench/test_bench.py)."""

from __future__ import annotations

import gc
import random
import tracemalloc
import uuid

import pytest

from core import codecs
from fakes.traffic import PROMPT_SHAPES, one_call_prompt, through_memo


@pytest.mark.parametrize("tokens", [100, 600, 3000])
@pytest.mark.parametrize("shape", PROMPT_SHAPES)
@pytest.mark.slow
def test_the_memo_accounts_what_it_holds(shape: str, tokens: int) -> None:
    """Against tracemalloc, over 500 one-call episodes whose prompts only the memo keeps alive:
    within 1.25x under (allocator and version noise; the bound is what must not be exceeded by
    much) and 1.5x over (a memo holding less than its bound costs only hashing)."""
    rng, n = random.Random(tokens), 500
    memo = codecs.PromptMemo(max_bytes=2**40, max_entries=10**9)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            messages, ids = one_call_prompt(shape, rng, i, tokens)
            through_memo(memo, f"ep-{uuid.uuid4().hex}", messages, ids)
        del messages, ids
        codecs._chat_message_digest.cache_clear()  # (bounded on its own: MEMO_SIZE)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    if len(memo) == 0:  # a short prompt of list content or no chat text: nothing to reuse
        assert memo.nbytes == 0 and held < 100 * n, held
    else:
        assert len(memo) == n
        assert held / 1.25 < memo.nbytes < held * 1.5, (memo.nbytes / n, held / n)


def test_the_entry_and_byte_bounds_hold() -> None:
    rng = random.Random(1)
    for max_bytes, max_entries in ((2**30, 300), (400_000, 10**6)):
        memo = codecs.PromptMemo(max_bytes=max_bytes, max_entries=max_entries)
        for i in range(2000):
            messages, ids = one_call_prompt(PROMPT_SHAPES[i % 5], rng, i)
            through_memo(memo, f"ep-{i}", messages, ids)
            assert len(memo) <= max_entries and memo.nbytes <= max_bytes
        assert len(memo) == max_entries or memo.nbytes > max_bytes * 0.9  # and it fills


@pytest.mark.slow
def test_one_call_episodes_go_before_the_conversations_going_on() -> None:
    """50 conversations make two calls, then call again between floods of one-call episodes 10x
    the memo's size: each next call finds its episode's last prompt (the plain LRU it was
    forgot them all). (At its first call a conversation looks like a one-call episode.)"""
    rng, memo = random.Random(2), codecs.PromptMemo(max_entries=500)
    conversations = {f"conv-{i}": one_call_prompt("chat", rng, i) for i in range(50)}
    for turn in range(5):
        for episode, (messages, ids) in conversations.items():
            if turn:  # the whole last prompt's blocks and messages are known
                assert memo.known_blocks(episode)[1], (turn, episode)
            messages = [*messages, {"role": "user", "content": f"turn {turn}"}]
            ids = ids + [rng.randrange(150_000) for _ in range(300)]
            digests, blocks = through_memo(memo, episode, messages, ids)
            assert digests == [codecs.message_digest(m) for m in messages]
            assert blocks == codecs.split_blocks(codecs.pack(ids, "i"))[0]
            conversations[episode] = messages, ids
        for i in range(5000 if turn else 0):
            messages, ids = one_call_prompt(PROMPT_SHAPES[i % 5], rng, i)
            through_memo(memo, f"ep-{uuid.uuid4().hex}", messages, ids)
        assert len(memo) <= 500
