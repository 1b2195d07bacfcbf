"""Each token's own text, for the dashboard's tokens view (GET /ui/api/transitions/{id}/tokens):
vLLM's POST /detokenize, bounded and remembered.

vLLM 0.32's /detokenize has no per-token form (a `tokens` list in, one string out), so a token's
own text is one call of its own. A tokenizer's texts never change and a completion repeats its
tokens: each distinct id is asked once per proxy (an LRU of CACHE_ENTRIES), a page asks for at
most PER_REQUEST ids it has not seen, and at most CONCURRENCY calls run at once across every page.
A completion with more new ids than a page may ask for shows the rest as ids (`None`), filled in
as pages are read again.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from core.vllm import VLLMAdmin

CACHE_ENTRIES = 65_536  # ~100 B each; half a large vocabulary
PER_REQUEST = 256  # new ids one page asks vLLM for
CONCURRENCY = 4  # /detokenize calls at once, for every page together


class TokenTexts:
    def __init__(
        self,
        vllm: VLLMAdmin,
        *,
        entries: int = CACHE_ENTRIES,
        per_request: int = PER_REQUEST,
        concurrency: int = CONCURRENCY,
    ) -> None:
        self._vllm = vllm
        self._entries = entries
        self._per_request = per_request
        self._gate = asyncio.Semaphore(concurrency)
        self._known: OrderedDict[int, str] = OrderedDict()

    async def texts(self, base_url: str, token_ids: list[int]) -> tuple[list[str | None], int]:
        """Each id's text (None: not asked this time) and how many distinct ids were not asked.
        Raises core.vllm.VLLMError if vLLM refuses."""
        known = self._known
        have = {t: known[t] for t in dict.fromkeys(token_ids) if t in known}
        new = [t for t in dict.fromkeys(token_ids) if t not in have]
        asked = new[: self._per_request]
        found = await asyncio.gather(*(self._one(base_url, t) for t in asked))
        have.update(zip(asked, found, strict=True))
        for token_id, text in have.items():  # the most recently used last
            known[token_id] = text
            known.move_to_end(token_id)
        while len(known) > self._entries:
            known.popitem(last=False)
        texts = [have.get(t) for t in token_ids]
        return texts, len(new) - len(asked)

    async def _one(self, base_url: str, token_id: int) -> str:
        async with self._gate:
            return await self._vllm.token_text(base_url, token_id)
