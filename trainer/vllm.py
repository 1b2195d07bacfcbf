"""All outbound HTTP of the trainer: vLLM's adapter endpoints, on every replica.

vLLM reads an adapter's directory lazily and answers 400 to a name it already has, so every version
gets a new name and directory; a directory is deleted only after every vLLM unloaded it.
"""

from __future__ import annotations

import contextlib
import logging
import time

import httpx

log = logging.getLogger(__name__)

TIMEOUT_S = 60.0  # loading reads the adapter from disk; rank-8 adapters take milliseconds


class AdapterRejected(Exception):
    """A vLLM refused an adapter; the message is vLLM's own."""


class VLLMAdmin:
    def __init__(self, urls: list[str], api_key: str | None) -> None:
        self.urls = urls
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(TIMEOUT_S, connect=5.0))

    def close(self) -> None:
        self._http.close()

    def loaded(self, url: str) -> set[str]:
        """The adapters a vLLM has loaded (models with a parent)."""
        response = self._http.get(f"{url}/v1/models")
        response.raise_for_status()
        return {m["id"] for m in response.json()["data"] if m.get("parent")}

    def load(self, url: str, name: str, path: str) -> None:
        response = self._http.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
        )
        if response.status_code != 200:
            raise AdapterRejected(f"{url} refused {name}: {response.status_code} {response.text}")

    def unload(self, url: str, name: str) -> None:
        response = self._http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
        if response.status_code not in (200, 404):  # 404: already gone, which is what we want
            raise AdapterRejected(f"{url} would not unload {name}: {response.text}")

    def load_everywhere(self, name: str, path: str) -> float:
        """Load into every vLLM that answers, or into none: a refusal unloads it everywhere.

        A replica that cannot be reached is skipped (and logged): the proxy keeps it out of
        rotation and loads the current adapter into it before it takes policy traffic again, and
        `Trainer.reconcile` catches it up too. At least one replica must take the adapter.
        """
        started = time.perf_counter()
        done: list[str] = []
        unreachable: list[str] = []
        try:
            for url in self.urls:
                try:
                    if name not in self.loaded(url):
                        self.load(url, name, path)
                except httpx.TransportError as e:
                    log.warning("vLLM %s unreachable, not loading %s there now: %r", url, name, e)
                    unreachable.append(url)
                    continue
                done.append(url)
            if not done:
                raise AdapterRejected(f"no vLLM reachable to load {name}: {', '.join(unreachable)}")
        except (AdapterRejected, httpx.HTTPError):
            for url in done:
                # If this fails too, that replica keeps an unused adapter until reconcile.
                with contextlib.suppress(AdapterRejected, httpx.HTTPError):
                    self.unload(url, name)
            raise
        return time.perf_counter() - started

    def unload_everywhere(self, name: str) -> None:
        for url in self.urls:
            self.unload(url, name)
