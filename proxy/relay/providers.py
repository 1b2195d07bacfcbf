"""Provider models: model names served by providers, not by vLLM (FLYWHEEL_ROUTES), through
litellm: one client for OpenAI, Anthropic, Bedrock, ... with their keys, retries, quirks and
prices.

A multi-agent system points all its agents at the proxy; the calls of a provider model go to its
provider and are recorded like any other, as transitions of their agent and episode (messages,
text, tool calls, tokens counted by the provider, `provider` and `cost_usd` set), with no token
ids or logprobs and no lineage: a trainer never claims them, and export carries them like the
rest. Only chat completions go to providers (litellm's common ground across them).

litellm is imported when the proxy starts with provider models (the `litellm` extra; it needs
openai<3, so it is the proxy image's, never the dev venv's): without them it costs nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncGenerator
from typing import Any

from proxy.config import ProviderModel

# What a client's body holds that is ours or litellm's to set.
_OURS = ("model", "messages", "stream", "stream_options")
# OpenAI's chat parameters, which litellm maps for each provider. Anything else a client sends
# goes to the provider as it is (`extra_body`), never to litellm as an argument: a body saying
# `base_url` or `api_key` must not steer the call, with the provider model's key, elsewhere.
OPENAI_PARAMS = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "metadata",
        "modalities",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)


class ProviderFailed(Exception):
    """A provider (or litellm on its way there) refused or failed a call: its status and an
    OpenAI-shaped error body for the client."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body = status, body


class Providers:
    def __init__(self, models: dict[str, ProviderModel], *, timeout_s: float, retries: int) -> None:
        self.models = models
        self._timeout_s, self._retries = timeout_s, retries
        self._litellm = _import_litellm()

    def get(self, model: str) -> ProviderModel | None:
        return self.models.get(model)

    async def complete(self, provider_model: ProviderModel, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streaming chat completion, as the OpenAI-shaped dict the client gets."""
        response = await self._call(provider_model, body, stream=False)
        return _plain(response.model_dump(exclude_none=True))

    async def stream(
        self, provider_model: ProviderModel, body: dict[str, Any]
    ) -> AsyncGenerator[dict[str, Any]]:
        """A streaming chat completion, started (so a refusal raises here, before any byte goes
        to the client): its chunks as OpenAI-shaped dicts, the last one with the usage."""
        options = body.get("stream_options")
        options = {**options} if isinstance(options, dict) else {}
        options["include_usage"] = True  # the tokens to record (the forwarder strips it)
        with_usage = {**body, "stream_options": options}
        response = await self._call(provider_model, with_usage, stream=True)
        return self._chunks(response)

    async def _chunks(self, response: Any) -> AsyncGenerator[dict[str, Any]]:
        try:
            async for chunk in response:
                yield _plain(chunk.model_dump(exclude_none=True))
        except Exception as e:
            raise self._failed(e) from e
        finally:
            await _close(response)

    def cost(self, provider_model: ProviderModel, usage: dict[str, Any] | None) -> float | None:
        """The call's price in USD from its usage: the provider model's prices, else litellm's
        table."""
        if not usage:
            return None
        prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
        per_input, per_output = (
            provider_model.input_cost_per_token,
            provider_model.output_cost_per_token,
        )
        if per_input is not None or per_output is not None:
            return prompt * (per_input or 0.0) + completion * (per_output or 0.0)
        try:
            costs = self._litellm.cost_per_token(
                model=provider_model.model, prompt_tokens=prompt, completion_tokens=completion
            )
        except Exception:  # a model litellm has no price for
            return None
        return float(sum(costs))

    async def _call(
        self, provider_model: ProviderModel, body: dict[str, Any], *, stream: bool
    ) -> Any:
        params = {k: v for k, v in body.items() if k in OPENAI_PARAMS}
        extra = {k: v for k, v in body.items() if k not in OPENAI_PARAMS and k not in _OURS}
        if extra:
            params["extra_body"] = extra
        if stream:
            params["stream_options"] = body["stream_options"]
        key_env = provider_model.api_key_env
        api_key = os.environ.get(key_env) if key_env else None
        try:
            return await self._litellm.acompletion(
                model=provider_model.model,
                messages=body.get("messages"),
                stream=stream,
                api_base=provider_model.api_base,
                api_key=api_key,
                timeout=self._timeout_s,
                num_retries=self._retries,
                **params,
            )
        except Exception as e:
            raise self._failed(e) from e

    def _failed(self, e: Exception) -> ProviderFailed:
        status = getattr(e, "status_code", None)
        if not isinstance(status, int) or not 400 <= status <= 599 or _unreachable(e):
            status = 502  # (litellm says 500 when it could not connect)
        if isinstance(e, self._litellm.Timeout):
            status = 504
        message = getattr(e, "message", None) or str(e) or type(e).__name__
        error = {"message": message, "type": "provider_error", "code": type(e).__name__}
        return ProviderFailed(status, {"error": error})


def _unreachable(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, ConnectionError):
            return True
        e = e.__cause__ or e.__context__
    return False


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    """litellm's answer less its own additions (`provider_specific_fields` on each choice and
    message): what the provider said, in OpenAI's shape."""
    for choice in data.get("choices") or ():
        choice.pop("provider_specific_fields", None)
        for key in ("message", "delta"):
            if isinstance(choice.get(key), dict):
                choice[key].pop("provider_specific_fields", None)
    return data


async def _close(response: Any) -> None:
    """Close the provider's stream (a client that left stops the generation it pays for)."""
    with contextlib.suppress(Exception):  # already closed
        await response.aclose()


def _import_litellm() -> Any:
    # litellm fetches its price list from GitHub at import unless told to use the copy it ships.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm

        litellm.suppress_debug_info = True  # its "Give Feedback" banner on every error
    except ImportError as e:
        raise RuntimeError(
            "FLYWHEEL_ROUTES needs litellm: pip install 'flywheel[litellm]' (the proxy image "
            "has it)"
        ) from e
    return litellm
