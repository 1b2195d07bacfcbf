"""Automatic intermediate rewards (the paper's AIR): what the proxy can tell about a tool call
by itself, without waiting for the application.

A recorded transition's tool calls are checked against the tools its request declared:
- `undeclared_tool`: the name is not among the declared function tools;
- `invalid_json`: the arguments are not JSON (tool parsers that pass the model's text through);
- `schema_violation`: the arguments break the tool's JSON schema (checked by `jsonschema`);
- `unparsed_call`: tools were declared, no call was parsed, yet the text holds the model's
  tool-call marker (`<tool_call>` for Hermes/Qwen models): vLLM's parser rejected what the
  model wrote, which is how invalid JSON shows on those models.
The errors are stored with the transition (`tool_errors`); with a penalty set, the writer adds an
intermediate reward of minus the penalty with source `air`, which credit assignment adds to the
transition's return (proxy/record/store/rewards.py). Off unless `FLYWHEEL_AIR_PENALTY` is set.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson
from jsonschema import SchemaError, validators
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator

from core.record import TransitionRecord

VALIDATORS_MAX = 512  # compiled schemas kept (a deployment has a handful of tool sets)
DETAIL_MAX = 300  # characters of a validator's message kept


class ToolCheck:
    """Checks recorded tool calls; compiled validators are cached by schema."""

    def __init__(self, marker: str = "<tool_call>") -> None:
        self._marker = marker
        self._validators: OrderedDict[bytes, Validator | None] = OrderedDict()

    def errors(self, tools: Any, record: TransitionRecord) -> list[dict[str, Any]] | None:
        """The record's tool-call errors under the request's `tools`; None when there are none
        (or nothing was declared to check against)."""
        declared = declared_functions(tools)
        if declared is None:
            return None
        found = []
        for index, call in enumerate(record.tool_calls or ()):
            error = self._call_error(call, declared)
            if error is not None:
                kind, detail = error
                found.append(
                    {
                        "index": index,
                        "id": call.get("id"),
                        "name": (call.get("function") or {}).get("name"),
                        "kind": kind,
                        "detail": detail[:DETAIL_MAX],
                    }
                )
        if not record.tool_calls and self._marker and self._marker in (record.text or ""):
            found.append(
                {
                    "index": None,
                    "id": None,
                    "name": None,
                    "kind": "unparsed_call",
                    "detail": f"the text holds {self._marker!r} but no tool call was parsed",
                }
            )
        return found or None

    def _call_error(self, call: dict[str, Any], declared: dict[str, Any]) -> tuple[str, str] | None:
        function = call.get("function") or {}
        name = function.get("name")
        if name not in declared:
            names = ", ".join(sorted(n for n in declared if isinstance(n, str))) or "none"
            return "undeclared_tool", f"{name!r} is not a declared tool (declared: {names})"
        raw = function.get("arguments")
        try:
            arguments = orjson.loads(raw) if isinstance(raw, str | bytes) else raw
        except orjson.JSONDecodeError as e:
            return "invalid_json", f"the arguments are not JSON: {e}"
        validator = self._validator(declared[name])
        if validator is None:
            return None
        error = best_match(validator.iter_errors(arguments))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return "schema_violation", f"{where + ': ' if where else ''}{error.message}"

    def _validator(self, schema: Any) -> Validator | None:
        """The schema compiled (None: no schema, or one that is itself invalid: nothing to hold
        the model to). Least recently used schemas are forgotten first."""
        if not isinstance(schema, dict):
            return None
        key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
        if key in self._validators:
            self._validators.move_to_end(key)
            return self._validators[key]
        cls = validators.validator_for(schema)
        try:
            cls.check_schema(schema)
            validator: Validator | None = cls(schema)
        except SchemaError:
            validator = None
        self._validators[key] = validator
        if len(self._validators) > VALIDATORS_MAX:
            self._validators.popitem(last=False)
        return validator


def declared_functions(tools: Any) -> dict[str, Any] | None:
    """name -> parameters schema of the request's function tools, in any of the wire shapes (chat:
    {"type": "function", "function": {...}}; Responses: {"type": "function", "name": ...};
    Anthropic's Messages: {"name", "input_schema"}, `type` absent or "custom"). None when the
    request declared no tools, or tools of kinds whose calls cannot be checked."""
    if not isinstance(tools, list) or not tools:
        return None
    declared: dict[str, Any] = {}
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        if "input_schema" in tool and tool.get("type") in (None, "custom"):
            tool = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        elif tool.get("type") != "function":
            return None  # built-in or custom tools: a call may name them, we cannot tell
        nested = tool.get("function")
        function: dict[str, Any] = nested if isinstance(nested, dict) else tool
        name = function.get("name")
        if isinstance(name, str):
            declared[name] = function.get("parameters")
    return declared or None
