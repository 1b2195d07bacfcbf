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

    def ask(
        self, bodies: list[dict[str, Any]], *, concurrency: int, timeout_s: float
    ) -> list[dict[str, Any]]:
        """Chat completions, `concurrency` at a time, round-robin over the replicas: vLLM's
        answers in order (the first that fails raises; the others are cancelled)."""
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int, body: dict[str, Any]) -> dict[str, Any]:
            async with gate:
                url = self.urls[i % len(self.urls)]
                return await self._vllm.chat(url, body, timeout_s=timeout_s)

        async def every() -> list[dict[str, Any]]:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(i, b)) for i, b in enumerate(bodies)]
            return [t.result() for t in tasks]

        try:
            return self._run(every())
        except ExceptionGroup as failed:  # the first call's error, as one call would raise it
            raise failed.exceptions[0] from None

    def base_model(self) -> str:
        """The name the (first) vLLM serves the base model under."""
        return self._run(self._vllm.base_model(self.urls[0]))

    def loaded(self, url: str) -> set[str]:
        return self._run(self._vllm.loaded(url))

    def load(self, url: str, name: str, path: str) -> None:
        self._run(self._vllm.load(url, name, path))

    def unload(self, url: str, name: str) -> None:
        self._run(self._vllm.unload(url, name))
