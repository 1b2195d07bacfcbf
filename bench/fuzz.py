"""Fuzzing every route of a running proxy: generated bodies, headers and path tags.

    PYTHONPATH=. .venv/bin/python -m bench.fuzz [--examples 500] [--note "..."]

- Every route the proxy's OpenAPI document describes (proxy/openapi.py: the completion routes
  too), by Schemathesis from `/openapi.json`, valid and invalid ("negative") cases.
- The completion routes again (the proxy's fast lane, answered by the fake vLLM here), by
  Hypothesis: JSON of every shape and type, bodies that are not JSON, and arbitrary
  episode/task/agent tags in headers and in the path.

Counted: cases, answers by status class, server errors (5xx: must be 0), hangs (no answer in
10 s: must be 0), and whether Postgres holds exactly what was acknowledged: every transition id
the proxy answered with and nothing else (refused input stores nothing). Prints a table and
appends it to bench/fuzz.md; tests/bench/test_fuzz.py runs it at a small size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import string
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from bench import common
from fakes import processes

RESULTS = Path(__file__).with_suffix(".md")
TIMEOUT_S = 10.0
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@dataclass
class Tally:
    cases: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # what was sent, for the report
    hangs: list[str] = field(default_factory=list)
    acknowledged: set[str] = field(default_factory=set)  # transition ids answered with

    def record(self, what: str, response: httpx.Response | None) -> None:
        self.cases += 1
        if response is None:
            self.hangs.append(what)
            return
        self.statuses[f"{response.status_code // 100}xx"] += 1
        if response.status_code >= 500:
            self.server_errors.append(f"{response.status_code} {what}: {response.text[:200]}")
        ids = response.headers.get("x-transition-id")
        if ids:
            self.acknowledged.update(ids.split(","))


def _dumps(body: Any) -> bytes:
    """JSON as a client might send it (integers beyond 64 bits included: orjson refuses them)."""
    return json.dumps(body).encode()


def _send(client: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response | None:
    try:
        return client.request(method, url, timeout=TIMEOUT_S, **kwargs)
    except httpx.TimeoutException:
        return None


# --- the OpenAPI-described routes (Schemathesis) ------------------------------------------------


def fuzz_openapi(base_url: str, examples: int, tally: Tally) -> None:
    raw = httpx.get(base_url + "/openapi.json").json()
    results: Any = schemathesis.openapi.from_dict(raw).get_all_operations()
    with httpx.Client(base_url=base_url) as client:
        for result in results:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz_operation(client, base_url, result.ok(), mode, examples, tally)


def _fuzz_operation(
    client: httpx.Client,
    base_url: str,
    operation: Any,
    mode: GenerationMode,
    examples: int,
    tally: Tally,
) -> None:
    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case: Any) -> None:
        kwargs = case.as_transport_kwargs(base_url=base_url)
        # Whitespace around a header value is no part of it (RFC 9110), and httpx refuses to send
        # it (the security schemes' generated `Authorization: Bearer `).
        headers = {k: str(v).strip() for k, v in (kwargs.get("headers") or {}).items()}
        body = kwargs.get("json")
        if body is not None and "content-type" not in {k.lower() for k in headers}:
            headers["Content-Type"] = "application/json"  # as json= would: the proxy wants it
        content = _dumps(body) if body is not None else kwargs.get("data")
        response = _send(
            client,
            kwargs["method"],
            kwargs["url"],
            headers=headers,
            params=kwargs.get("params"),
            content=content,
        )
        tally.record(f"{operation.label} {str(body)[:120]}", response)

    with contextlib.suppress(Unsatisfiable):  # nothing to make invalid (no parameters, no body)
        call()


# --- the completion routes (Hypothesis) --------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=50)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]) | _scalars},
    optional={"content": _json, "tool_calls": _json, "name": _json, "tool_call_id": _json},
)
_block = st.fixed_dictionaries(  # an Anthropic Messages content block
    {"type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking"]) | _json},
    optional={k: _json for k in ("text", "source", "id", "name", "input", "tool_use_id")}
    | {"content": _json | st.lists(_json, max_size=3), "thinking": _json},
)
_field_values = {
    "model": st.sampled_from(["demo", "policy", "policy@0", "policy@99", "nope"]) | _json,
    "messages": st.lists(_message, max_size=3) | _json,
    "prompt": st.text(max_size=40) | _json,
    "input": st.text(max_size=40) | st.lists(_json, max_size=3) | _json,
    "max_tokens": st.integers(min_value=-5, max_value=40) | _json,
    "n": st.integers(min_value=-1, max_value=4) | _json,
    "stream": st.booleans() | _json,
    "logprobs": st.booleans() | _json,
    "temperature": st.floats(min_value=-1, max_value=3, allow_nan=False) | _json,
    "tools": _json,
    "previous_response_id": _json,
    "system": st.text(max_size=20) | st.lists(_block, max_size=2) | _json,
    "stop_sequences": st.lists(st.text(max_size=5), max_size=2) | _json,
    "tool_choice": _json,
    "top_k": _json,
    "metadata": _json,
    "thinking": _json,
}
_bodies = (
    st.fixed_dictionaries({}, optional=_field_values).map(lambda b: _dumps(b))
    | _json.map(lambda b: _dumps(b))
    | st.binary(max_size=64)
)
_PROMPTS = {
    "/v1/chat/completions": (
        "messages",
        st.builds(lambda t: [{"role": "user", "content": t}], st.text(max_size=30)),
    ),
    "/v1/completions": ("prompt", st.text(min_size=1, max_size=30)),
    "/v1/responses": ("input", st.text(min_size=1, max_size=30)),
    "/v1/messages": (
        "messages",
        st.builds(
            lambda c: [{"role": "user", "content": c}],
            st.text(max_size=30) | st.lists(_block, min_size=1, max_size=3),
        ),
    ),
}


def _near_valid(path: str) -> st.SearchStrategy[bytes]:
    """A valid call with up to two fields replaced or added with anything: what gets past a
    first check and finds the deeper ones."""
    key, prompt = _PROMPTS[path]
    base = st.fixed_dictionaries(
        {"model": st.just("demo"), key: prompt, "max_tokens": st.integers(1, 8)},
        optional={"stream": st.booleans(), "n": st.integers(1, 3), "logprobs": st.booleans()},
    )
    changes = st.dictionaries(st.sampled_from(sorted(_field_values)), _json, max_size=2)
    return st.tuples(base, changes).map(lambda bc: _dumps({**bc[0], **bc[1]}))


_calls = st.sampled_from(COMPLETION_PATHS).flatmap(
    lambda path: st.tuples(st.just(path), _near_valid(path) | _bodies)
)
_tag = st.text(alphabet=string.printable + "é/%\x00", max_size=30)
_headers = st.dictionaries(
    st.sampled_from(["X-Episode-Id", "X-Task-Id", "X-Agent-Name", "Content-Type"]),
    _tag.filter(lambda v: v.isprintable() and v == v.strip()),  # what an HTTP client can send
    max_size=3,
)
_prefix = st.lists(
    st.tuples(st.sampled_from(["episode", "task", "agent", "bogus"]), _tag), max_size=3
)


def fuzz_completions(base_url: str, examples: int, tally: Tally) -> None:
    with httpx.Client(base_url=base_url) as client:

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(request=_calls, headers=_headers, prefix=_prefix)
        def call(request: tuple[str, bytes], headers: dict[str, str], prefix: list[Any]) -> None:
            path, body = request
            tags = "".join(f"/{k}/{quote(v, safe='')}" for k, v in prefix if v)
            raw = {"Content-Type": b"application/json"}  # unless the case sends its own
            raw |= {k: v.encode() for k, v in headers.items()}  # UTF-8 bytes, as some clients do
            response = _send(client, "POST", tags + path, content=body, headers=raw)
            tally.record(f"POST {tags}{path} {headers} {body[:120]!r}", response)

        call()


# --- what Postgres holds afterwards -------------------------------------------------------------


def stored_matches(database_url: str, tally: Tally, timeout: float = 30.0) -> tuple[int, int]:
    """(acknowledged transitions missing from Postgres, transitions stored but never answered),
    once the writer caught up."""
    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(database_url) as conn:
            stored = {r[0] for r in conn.execute("SELECT id::text FROM transition").fetchall()}
        missing = tally.acknowledged - stored
        if not missing or time.monotonic() > deadline:
            return len(missing), len(stored - tally.acknowledged)
        time.sleep(0.2)


def report_lines(tally: Tally, missing: int, extra: int) -> list[str]:
    lines = [
        "| cases | 2xx | 4xx | 5xx (server errors) | hangs | acknowledged transitions "
        "| missing from Postgres | stored though refused |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {tally.cases} | {tally.statuses['2xx']} | {tally.statuses['4xx']} "
        f"| {len(tally.server_errors)} | {len(tally.hangs)} | {len(tally.acknowledged)} "
        f"| {missing} | {extra} |",
    ]
    for what in (tally.server_errors + tally.hangs)[:10]:
        lines.append(f"\n    {what}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=500, help="per operation and mode")
    parser.add_argument(
        "--completion-examples", type=int, help="on the completion routes (default 4 x examples)"
    )
    parser.add_argument("--database-url")
    parser.add_argument("--note")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    completion_examples = args.completion_examples or args.examples * 4
    fake = processes.start_fake(0.001, always_detail=False)
    try:
        with common.bench_database(args.database_url) as db:
            proxy = processes.start_flywheel(fake.url, db, home=Path(tempfile.mkdtemp()))
            tally = Tally()
            try:
                fuzz_openapi(proxy.url, args.examples, tally)
                fuzz_completions(proxy.url, completion_examples, tally)
                missing, extra = stored_matches(db, tally)
            finally:
                proxy.stop()
    finally:
        fake.stop()
    lines = report_lines(tally, missing, extra)
    print("\n".join(lines))
    header = f"{args.examples} examples per OpenAPI operation and mode, {completion_examples} on "
    header += "the completion routes; fake vLLM (1 ms), real Postgres."
    header += f" {args.note}" if args.note else ""
    common.append_section(args.results, "Fuzzing every route", "bench.fuzz", [header, "", *lines])


if __name__ == "__main__":
    main()
