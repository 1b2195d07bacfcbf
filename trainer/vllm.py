"""The trainer's hands on every vLLM: core's adapter client (core/vllm.py) and the one
load-everywhere policy (core/rollout.py), run on a private event loop.

The trainer is synchronous (torch), so each call here blocks until every replica has answered,
as it should: a step publishes only once its adapter is loaded. No event loop is set for the
thread, so this does not meddle with anyone else's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from core import rollout
from core.vllm import VLLMAdmin

T = TypeVar("T")


class Replicas:
    def __init__(self, urls: list[str], api_key: str | None) -> None:
        self.urls = urls
        self._loop = asyncio.new_event_loop()
        self._vllm = VLLMAdmin(api_key=api_key)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        task = self._loop.create_task(coroutine)
        try:
            return self._loop.run_until_complete(task)
        except BaseException:  # SIGTERM's Stopping mid-call: no orphan task left to run later
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                self._loop.run_until_complete(task)
            raise

    def close(self) -> None:
        self._run(self._vllm.close())
        self._loop.close()

    def load_everywhere(self, name: str, path: str) -> rollout.Rollout:
        """core.rollout.load_everywhere: raises AdapterRejected or NoReplica (nothing loaded)."""
        return self._run(rollout.load_everywhere(self._vllm, self.urls, name, path))

    def unload_everywhere(self, name: str) -> None:
        self._run(rollout.unload_everywhere(self._vllm, self.urls, name))

    def loaded(self, url: str) -> set[str]:
        return self._run(self._vllm.loaded(url))

    def load(self, url: str, name: str, path: str) -> None:
        self._run(self._vllm.load(url, name, path))

    def unload(self, url: str, name: str) -> None:
        self._run(self._vllm.unload(url, name))
