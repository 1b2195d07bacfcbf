"""All outbound HTTP of the proxy: calls to vLLM.

One `Upstream` holds the replicas. Today `pick()` keeps an episode on one replica (rendezvous
hashing, so its prefix cache is reused); spreading by load and ejecting dead replicas belongs here
too when it comes (issue 4).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

CONNECT_TIMEOUT_S = 10.0  # vLLM on the same network answers a TCP connect in milliseconds
MODELS_TIMEOUT_S = 10.0


class AdapterError(Exception):
    """vLLM would not list or load an adapter; the message is vLLM's."""


@dataclass(frozen=True)
class Replica:
    base_url: str  # without /v1


class Upstream:
    def __init__(self, urls: list[str], *, api_key: str | None, timeout_s: float) -> None:
        if not urls:
            raise ValueError("no upstream: pass --upstream URL (or FLYWHEEL_UPSTREAM)")
        self.replicas = [Replica(url) for url in urls]
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=CONNECT_TIMEOUT_S)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No connection limit: vLLM, not the proxy, decides how many requests it batches.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            json_serialize=lambda o: orjson.dumps(o).decode(),
            auto_decompress=True,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def pick(self, episode_id: str) -> Replica:
        if len(self.replicas) == 1:
            return self.replicas[0]
        key = episode_id.encode()
        return max(
            self.replicas,
            key=lambda r: hashlib.blake2b(key + r.base_url.encode(), digest_size=8).digest(),
        )

    def post(self, replica: Replica, path: str, body: bytes) -> Any:
        """Start a POST; use as `async with upstream.post(...) as response:`."""
        assert self._session is not None, "Upstream.start() was not awaited"
        return self._session.post(replica.base_url + path, data=body, headers=self._headers)

    async def loaded_adapters(self, replica: Replica) -> set[str]:
        status, body = await self.models(replica)
        if status != 200:
            raise AdapterError(f"{replica.base_url} did not list its models ({status})")
        return {m["id"] for m in orjson.loads(body)["data"] if m.get("parent")}

    async def load_adapter(self, replica: Replica, name: str, path: str) -> None:
        assert self._session is not None, "Upstream.start() was not awaited"
        async with self._session.post(
            replica.base_url + "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": path},
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S),
        ) as response:
            if response.status != 200:
                raise AdapterError(f"{replica.base_url}: {response.status} {await response.text()}")

    async def models(self, replica: Replica | None = None) -> tuple[int, bytes]:
        assert self._session is not None, "Upstream.start() was not awaited"
        replica = replica or self.replicas[0]
        async with self._session.get(
            replica.base_url + "/v1/models",
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S),
        ) as response:
            return response.status, await response.read()
