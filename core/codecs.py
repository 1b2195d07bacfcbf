"""How values are stored: token ids and logprobs packed, messages content-addressed, uuids and
digest arrays pre-packed in Postgres's binary format for COPY (core/pgcopy.py sends them as-is).

- token ids: little-endian int32 (`pack(ids, "i")`); logprobs: little-endian float32 (`"f"`);
- a prompt's token ids: its whole blocks of `BLOCK_TOKENS`, content-addressed like messages
  (`split_blocks`; readers join them back in SQL, core/tables.py `PROMPT_IDS_SQL`), and the rest
  packed in the row: a multi-turn episode's growing prompt, or a
  system prompt every episode shares, is stored once;
- a message: its 16-byte BLAKE2b digest of sorted-key JSON (`message_digest`);
- `PackedDigests`: a whole `bytea[]` of digests; `PackedUuid`: a uuid's 16 bytes.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from array import array
from collections import OrderedDict
from typing import Any, NamedTuple

import orjson

# --- token ids and logprobs -------------------------------------------------------------------


def pack(values: list[int] | list[float] | None, typecode: str) -> bytes | None:
    # struct packs a list ~2.5x faster than array(typecode, list) does (this is the writer's
    # biggest per-row cost: prompts of thousands of token ids), and "<" fixes the byte order.
    if values is None:
        return None
    return struct.pack(f"<{len(values)}{typecode}", *values)


def unpack(data: bytes | None, typecode: str) -> list[Any] | None:
    if data is None:
        return None
    values = array(typecode)
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


# --- prompts' token ids, in content-addressed blocks -------------------------------------------

# 256 ids are a 1 KiB block, named by a 16-byte digest: 1.6% of what it names. A prompt shorter
# than one block is stored whole in its row, as before.
BLOCK_TOKENS = 256
_BLOCK_BYTES = 4 * BLOCK_TOKENS


def split_blocks(
    packed: bytes | None, known: tuple[bytes, list[bytes]] = (b"", [])
) -> tuple[list[bytes], list[bytes], bytes | None]:
    """A packed prompt as (digests of its whole blocks, those blocks, the packed rest). Blocks
    are cut at fixed offsets from the start, so a prompt that extends another (the next call of
    a conversation) shares all of the other's whole blocks. `known`: whole blocks of packed ids
    and their digests (the episode's previous prompt, `PromptMemo`): if the prompt starts with
    them, their digests are reused and only the blocks after them are hashed."""
    if packed is None or len(packed) < _BLOCK_BYTES:
        return [], [], packed
    whole = len(packed) - len(packed) % _BLOCK_BYTES
    view = memoryview(packed)
    blocks = [bytes(view[i : i + _BLOCK_BYTES]) for i in range(0, whole, _BLOCK_BYTES)]
    prefix, digests = known
    if not (prefix and len(prefix) <= whole and packed.startswith(prefix)):
        prefix, digests = b"", []
    digests = digests[:]  # (the memo keeps its own list)
    digests += [hashlib.blake2b(b, digest_size=16).digest() for b in blocks[len(digests) :]]
    return digests, blocks, packed[whole:]


class _LastPrompt(NamedTuple):
    size: int  # what it holds, in bytes (_entry_bytes)
    messages: list[Any]  # the prompt's leading {role, content: str} messages: only those match
    digests: list[bytes]  # theirs
    blocks: bytes  # the prompt's whole blocks of packed ids
    block_digests: list[bytes]


# What an entry holds beyond its message texts and blocks, in bytes as tracemalloc counts them
# (CPython 3.11, 64-bit): the entry and its lists, the OrderedDict slot and the episode id
# (~450 B); a kept message's dict and its role (~250 B); a 16-byte digest as a bytes object and
# its list slot (~60 B). tests/proxy/record/test_prompt_memo.py holds the total to within 1.25x
# under and 1.5x over tracemalloc's count, for every shape of prompt.
ENTRY_BYTES, MESSAGE_BYTES, DIGEST_BYTES = 500, 250, 60
# The default bounds (FLYWHEEL_WRITER_MEMO_MAX_BYTES, _MAX_ENTRIES): a proxy has hundreds of
# conversations going at 100 calls/s; each entry of an 8k-token one holds ~60 KB.
PROMPT_MEMO_BYTES, PROMPT_MEMO_ENTRIES = 64 * 2**20, 10_000


class PromptMemo:
    """Each episode's last prompt with its digests: the next call of a conversation repeats
    that prompt and adds to it, so only its new messages and token blocks need hashing (a
    20-turn episode would otherwise hash its history 20 times). Pure content: never stale.

    Bounded by what it holds (`max_bytes`, each entry charged `ENTRY_BYTES` plus the sizes of
    the texts, digests and blocks it keeps) and by `max_entries`. It keeps only what can be
    reused: the leading chat messages with string content (the only ones compared) and the
    whole token blocks; a prompt with neither (a short prompt of list content, a completions or
    a typed Responses prompt under one block) is not kept at all, nor one over a quarter of
    `max_bytes`.

    One-call episodes (a call without X-Episode-Id gets a fresh id) go first: an episode's
    first prompt is kept on probation, and only an episode that calls again moves to the
    protected part (at most 3/4 of each bound; its least recently used move back to
    probation). The writer cannot tell a one-call episode at its first call (the client may
    reuse the id it is given), so it is kept, but a stream of them only churns probation.
    """

    def __init__(
        self, max_bytes: int = PROMPT_MEMO_BYTES, max_entries: int = PROMPT_MEMO_ENTRIES
    ) -> None:
        self._max_bytes, self._max_entries = max_bytes, max_entries
        self._probation: OrderedDict[str, _LastPrompt] = OrderedDict()  # seen once
        self._protected: OrderedDict[str, _LastPrompt] = OrderedDict()  # called again
        self.nbytes = 0  # what both parts hold
        self._protected_bytes = 0

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def _get(self, episode_id: str) -> _LastPrompt | None:
        last = self._protected.get(episode_id)
        return last if last is not None else self._probation.get(episode_id)

    def message_digests(self, episode_id: str, messages: list[Any]) -> list[bytes]:
        last = self._get(episode_id)
        if last is None:
            return [message_digest(m) for m in messages]
        same = 0
        for before, now in zip(last.messages, messages, strict=False):
            if not _same_chat_message(before, now):
                break
            same += 1
        return last.digests[:same] + [message_digest(m) for m in messages[same:]]

    def known_blocks(self, episode_id: str) -> tuple[bytes, list[bytes]]:
        last = self._get(episode_id)
        return (last.blocks, last.block_digests) if last is not None else (b"", [])

    def remember(
        self,
        episode_id: str,
        messages: list[Any],
        digests: list[bytes],
        packed: bytes | None,
        block_digests: list[bytes],
    ) -> None:
        blocks = packed[: _BLOCK_BYTES * len(block_digests)] if packed else b""
        chat = texts = 0  # the leading messages a next prompt can match (_same_chat_message)
        for m in messages:  # (one loop, no calls: this runs for every message of every call)
            if type(m) is not dict or len(m) != 2:
                break
            role, content = m.get("role"), m.get("content")
            if type(role) is not str or type(content) is not str:
                break
            texts += sys.getsizeof(content)
            chat += 1
        size = (
            ENTRY_BYTES
            + sys.getsizeof(blocks)
            + DIGEST_BYTES * (chat + len(block_digests))
            + MESSAGE_BYTES * chat
            + texts
        )
        kept = messages[:chat]
        again = self._pop(episode_id)  # the episode called before: it is not a one-call one
        if not (kept or block_digests) or size > self._max_bytes // 4:
            return  # nothing to reuse, or it would push out everything else
        entry = _LastPrompt(size, kept, digests[:chat], blocks, block_digests)
        (self._protected if again else self._probation)[episode_id] = entry
        self.nbytes += size
        self._protected_bytes += size if again else 0
        while (
            self._protected_bytes > self._max_bytes * 3 // 4
            or len(self._protected) > self._max_entries * 3 // 4
        ):  # the least recently used of them on probation again
            demoted, last = self._protected.popitem(last=False)
            self._protected_bytes -= last.size
            self._probation[demoted] = last
        while self.nbytes > self._max_bytes or len(self) > self._max_entries:
            part = self._probation or self._protected
            _, dropped = part.popitem(last=False)
            self.nbytes -= dropped.size
            if part is self._protected:
                self._protected_bytes -= dropped.size

    def _pop(self, episode_id: str) -> bool:
        """Forget the episode's entry; True if it had one."""
        last = self._protected.pop(episode_id, None)
        if last is not None:
            self._protected_bytes -= last.size
        else:
            last = self._probation.pop(episode_id, None)
        if last is None:
            return False
        self.nbytes -= last.size
        return True


def _same_chat_message(before: Any, now: Any) -> bool:
    """Equal as JSON, checked cheaply: only {role, content} strings (Python's == says
    1 == 1.0 == True, which JSON does not)."""
    return (
        type(before) is dict
        and type(now) is dict
        and len(before) == len(now) == 2
        and type(now.get("content")) is str
        and type(now.get("role")) is str
        and before == now
    )


# --- messages, by digest ----------------------------------------------------------------------


def message_digest(body: Any) -> bytes:
    if (
        type(body) is dict
        and len(body) == 2
        and type(role := body.get("role")) is str
        and type(content := body.get("content")) is str
        and len(content) <= MEMO_MAX_CHARS
    ):
        return _chat_message_digest(role, content)
    return _digest(body)


def _digest(body: Any) -> bytes:
    return hashlib.blake2b(orjson.dumps(body, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()


# A system prompt and an episode's history come back in every call, each time as new objects:
# hashing the text (Python's str hash) to find its digest costs a fraction of serialising and
# BLAKE2b-hashing it again. Bounded: at most MEMO_SIZE texts of at most MEMO_MAX_CHARS.
MEMO_SIZE, MEMO_MAX_CHARS = 8192, 2048


@functools.lru_cache(maxsize=MEMO_SIZE)
def _chat_message_digest(role: str, content: str) -> bytes:
    return _digest({"role": role, "content": content})


# --- Postgres binary values, packed here and sent as they are ---------------------------------

BYTEA_OID, BYTEA_ARRAY_OID, UUID_OID = 17, 1001, 2950


class PackedDigests(bytes):
    """A `bytea[]` of 16-byte digests in Postgres's binary array format."""


class PackedUuid(bytes):
    """A uuid's 16 bytes (`packed_uuid` returns plain bytes: COPY picks dumpers by column type)."""


# The binary array: ndim, has-nulls flag, element oid, (length, lower bound) of the one dimension,
# then each element as its 4-byte length and its bytes. An empty array has no dimensions.
_EMPTY_ARRAY = struct.pack(">iiI", 0, 0, BYTEA_OID)
_DIGEST_LENGTH = struct.pack(">i", 16)


def pack_digests(digests: list[bytes]) -> PackedDigests:
    if not digests:
        return PackedDigests(_EMPTY_ARRAY)
    header = struct.pack(">iiIii", 1, 0, BYTEA_OID, len(digests), 1)
    return PackedDigests(header + _DIGEST_LENGTH + _DIGEST_LENGTH.join(digests))


def packed_uuid(value: str) -> bytes:
    """A uuid string's 16 bytes (COPY dumps a `uuid` column by its type, whatever the class)."""
    # 5x cheaper than uuid.UUID(value).bytes; Postgres refuses anything but 16 bytes.
    return bytes.fromhex(value.replace("-", ""))
