"""What each transition was sampled with, read from its recorded request (torch-free).

The trainer recomputes a completion's log-probabilities under the very distribution vLLM drew it
from (docs/off_policy.md): the same temperature, min-p, top-k and top-p, logit bias, allowed
tokens and presence / frequency / repetition penalties, in vLLM's order
(trainer/learner/logprobs.py).
`sampling_of` reads those settings from a transition's recorded `params` the way vLLM 0.32 does
(a value the request leaves out is the server's default, then OpenAI's), or says why the call
cannot be trained exactly: greedy calls carry no exploration, and what vLLM decided by a grammar
or by settings the trainer does not reproduce would bias every importance ratio.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from core import anthropic

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy decoding
LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps each bias into [-100, 100]

# The sampling settings vLLM's default-taking requests read (chat, completions and Responses),
# with OpenAI's defaults; a server started with `--generation-config auto` takes its defaults
# from the model's generation_config.json instead (`server_defaults`).
OPENAI_DEFAULTS: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}

# Why a transition is set aside for its sampling, and what to change. `flywheel status` shows
# these next to the counts (core/trainable.py has the same table for every reason).
GREEDY = "greedy"
CONSTRAINED = "constrained_decoding"
UNSUPPORTED = "unsupported_sampling"


@dataclass(frozen=True)
class Sampling:
    """The settings one completion was drawn with (vLLM's meanings; `top_k` 0: off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None

    @property
    def penalised(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def plain(self) -> bool:
        """Temperature 1 and nothing else: the model's own distribution."""
        return (
            self.temperature == 1.0
            and not self.truncated
            and not self.penalised
            and not self.logit_bias
            and self.allowed_token_ids is None
        )


@dataclass(frozen=True)
class SetAside:
    reason: str
    detail: str


def server_defaults(mode: Literal["vllm", "auto"], model_dir: Path) -> dict[str, float]:
    """The defaults vLLM applies to what a request leaves out, for its `--generation-config`:
    `vllm` (how Flywheel's stack and images start it): none beyond OpenAI's; `auto` (vLLM's own
    default): the model's generation_config.json, for the keys vLLM reads from it."""
    if mode == "vllm":
        return {}
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    return {k: float(config[k]) for k in OPENAI_DEFAULTS if config.get(k) is not None}


def sampling_of(
    params: dict[str, Any],
    defaults: dict[str, float],
    *,
    made_tool_call: bool,
    route: str = "chat",
) -> Sampling | SetAside:
    """The settings a recorded call (its request minus the prompt) was sampled with. A Messages
    call (`route` "messages") recorded the Anthropic body as posted: its settings are those of
    the chat request the proxy sent vLLM for it (core/anthropic.py)."""
    if route == "messages":
        try:
            params = anthropic.sent_fields(params)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            return SetAside(UNSUPPORTED, f"unreadable Messages request: {e!r}")
    constrained = _constrained(params, made_tool_call)
    if constrained:
        return SetAside(CONSTRAINED, constrained)
    for name, why in _UNSUPPORTED.items():
        if params.get(name) not in (None, False, 0, [], {}, ""):
            return SetAside(UNSUPPORTED, f"{name}: {why}")
    if params.get("best_of") not in (None, params.get("n") or 1):
        return SetAside(UNSUPPORTED, "best_of: vLLM returned the best of more samples")
    try:
        value = {k: _number(params.get(k), defaults.get(k, d)) for k, d in OPENAI_DEFAULTS.items()}
        bias = _logit_bias(params.get("logit_bias"))
        allowed = params.get("allowed_token_ids")
        allowed_ids = None if allowed is None else tuple(sorted({int(t) for t in allowed}))
    except (TypeError, ValueError) as e:
        return SetAside(UNSUPPORTED, f"unreadable sampling settings: {e}")
    if value["temperature"] < SAMPLING_EPS:
        return SetAside(GREEDY, "temperature 0 (greedy decoding)")
    top_k = int(value["top_k"])
    return Sampling(
        temperature=value["temperature"],
        top_k=top_k if top_k > 0 else 0,  # -1 and 0 both mean off
        top_p=value["top_p"],
        min_p=value["min_p"],
        presence_penalty=value["presence_penalty"],
        frequency_penalty=value["frequency_penalty"],
        repetition_penalty=value["repetition_penalty"],
        logit_bias=bias,
        allowed_token_ids=allowed_ids,
    )


# Request fields that change what vLLM samples in ways the trainer does not reproduce.
_UNSUPPORTED = {
    "use_beam_search": "beam search picks among hypotheses; no sampled distribution",
    "bad_words": "bad-word masks are not reproduced by the trainer",
    "min_tokens": "the stop tokens masked until min_tokens are not reproduced by the trainer",
    "thinking_token_budget": "the thinking-budget processor is not reproduced by the trainer",
    "vllm_xargs": "custom logits processors are not reproduced by the trainer",
}


def _constrained(params: dict[str, Any], made_tool_call: bool) -> str | None:
    """Why vLLM held this completion to a grammar, if it did."""
    response_format = params.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return f"response_format {response_format.get('type')}"
    text = params.get("text")  # the Responses API's response_format
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return f"text.format {fmt.get('type')}"
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice"):
        if params.get(name) not in (None, {}):
            return name
    tool_choice = params.get("tool_choice")
    if params.get("tools") and (tool_choice == "required" or isinstance(tool_choice, dict)):
        return "tool_choice required or named (vLLM decodes the call to the tool's schema)"
    if made_tool_call and any(_strict(tool) for tool in params.get("tools") or ()):
        return "a call to strict tools (vLLM decodes it to the tool's schema)"
    return None


def _strict(tool: Any) -> bool:
    if not isinstance(tool, dict):
        return False
    function = tool.get("function")
    if isinstance(function, dict):  # chat: {"type": "function", "function": {..., "strict"}}
        return function.get("strict") is True
    return tool.get("strict") is True  # Responses: {"type": "function", ..., "strict"}


def _number(value: Any, default: float) -> float:
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    if not math.isfinite(value):
        raise ValueError(f"{value!r} is not finite")
    return float(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if not value:
        return ()
    if not isinstance(value, dict):
        raise TypeError("logit_bias is not an object")
    clamp = LOGIT_BIAS_LIMIT
    return tuple(
        sorted((int(k), min(clamp, max(-clamp, _number(v, 0.0)))) for k, v in value.items())
    )
