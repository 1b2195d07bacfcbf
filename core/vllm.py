"""vLLM's model list and LoRA endpoints, for every process: the proxy's probes and rollbacks, the
trainer's publish and retirement (the proxy's completion calls go through proxy/relay/http1.py).

vLLM answers 400 to loading a name it already has and reads an adapter's directory lazily, so
every version gets a new name and directory (core/policy.py).

Errors: `Unreachable` (no answer: refused, reset, timed out), `AdapterRejected` (vLLM answered
with a refusal; the message is its own), both `VLLMError`.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

CONNECT_TIMEOUT_S = 5.0
MODELS_TIMEOUT_S = 10.0  # vLLM's API server lists its models at once, however busy its engine
LOAD_TIMEOUT_S = 60.0  # loading reads the adapter from disk: milliseconds for rank 8, longer on
# a slow volume with a large rank


class VLLMError(Exception):
    """Talking to a vLLM did not work out."""


class Unreachable(VLLMError):
    """The vLLM did not answer (connection refused or lost, or it timed out)."""


class AdapterRejected(VLLMError):
    """The vLLM answered, with a refusal: its message is in ours."""


class VLLMAdmin:
    """One client for any number of vLLMs (each call names the base URL, without /v1)."""

    def __init__(self, *, api_key: str | None) -> None:
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:  # created on first use: it belongs to the running loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                headers=self._headers,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self, method: str, url: str, *, json: object = None, timeout_s: float
    ) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=CONNECT_TIMEOUT_S)
        data = None if json is None else orjson.dumps(json)
        try:
            async with self._http().request(method, url, data=data, timeout=timeout) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise Unreachable(f"{url}: {e!r}") from e

    async def models(
        self, base_url: str, *, timeout_s: float = MODELS_TIMEOUT_S
    ) -> tuple[int, bytes]:
        """GET /v1/models as vLLM answers it (status, body): the proxy passes it through."""
        return await self._call("GET", f"{base_url}/v1/models", timeout_s=timeout_s)

    async def loaded(self, base_url: str, *, timeout_s: float = MODELS_TIMEOUT_S) -> set[str]:
        """The adapters a vLLM has loaded (the models it lists with a parent)."""
        return set(await self.adapters(base_url, timeout_s=timeout_s))

    async def adapters(
        self, base_url: str, *, timeout_s: float = MODELS_TIMEOUT_S
    ) -> dict[str, str | None]:
        """The adapters a vLLM has loaded, each with the path it was loaded from (its `root`)."""
        status, body = await self.models(base_url, timeout_s=timeout_s)
        try:
            if status != 200:
                raise ValueError(f"status {status}")
            models = orjson.loads(body)["data"]
            return {m["id"]: m.get("root") for m in models if m.get("parent")}
        except (ValueError, KeyError, TypeError) as e:
            raise VLLMError(f"{base_url} did not list its models: {e}") from e

    async def load(self, base_url: str, name: str, path: str) -> None:
        status, body = await self._call(
            "POST",
            f"{base_url}/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": path},
            timeout_s=LOAD_TIMEOUT_S,
        )
        if status != 200:
            raise AdapterRejected(
                f"{base_url} refused {name}: {status} {body.decode(errors='replace')}"
            )

    async def unload(self, base_url: str, name: str) -> None:
        """Unload `name`; one that is not loaded is already what we want (404)."""
        status, body = await self._call(
            "POST",
            f"{base_url}/v1/unload_lora_adapter",
            json={"lora_name": name},
            timeout_s=LOAD_TIMEOUT_S,
        )
        if status not in (200, 404):
            raise AdapterRejected(
                f"{base_url} would not unload {name}: {status} {body.decode(errors='replace')}"
            )

    async def token_text(self, base_url: str, token_id: int) -> str:
        """One token's own text (vLLM's POST /detokenize has no per-token form: one `tokens`
        list in, one string out; a byte-level piece of a multi-byte character reads as U+FFFD)."""
        status, body = await self._call(
            "POST",
            f"{base_url}/detokenize",
            json={"tokens": [token_id]},
            timeout_s=MODELS_TIMEOUT_S,
        )
        if status != 200:
            raise VLLMError(f"{base_url}/detokenize: {status} {body[:200]!r}")
        return str(orjson.loads(body)["prompt"])

    async def base_model(self, base_url: str) -> str:
        """The name vLLM serves its base model under (the model it lists without a parent)."""
        status, body = await self.models(base_url)
        try:
            if status != 200:
                raise ValueError(f"status {status}")
            return str(next(m["id"] for m in orjson.loads(body)["data"] if not m.get("parent")))
        except (ValueError, KeyError, TypeError, StopIteration) as e:
            raise VLLMError(f"{base_url} did not list its base model: {e}") from e

    async def chat(
        self, base_url: str, body: dict[str, Any], *, timeout_s: float
    ) -> dict[str, Any]:
        """POST /v1/chat/completions: vLLM's answer, or VLLMError with its refusal."""
        status, answer = await self._call(
            "POST", f"{base_url}/v1/chat/completions", json=body, timeout_s=timeout_s
        )
        if status != 200:
            raise AdapterRejected(
                f"{base_url} answered {status}: {answer[:300].decode(errors='replace')}"
            )
        return dict(orjson.loads(answer))
