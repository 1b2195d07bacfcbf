"""Every route fuzzed at a small size (issue 13): bench/fuzz.py's generators against a running
proxy on the fake vLLM and real Postgres; `python -m bench.fuzz` runs the same at full size."""

from __future__ import annotations

import pytest

from bench.fuzz import Tally, fuzz_completions, fuzz_openapi, stored_matches
from tests.conftest import RunningProxy

pytestmark = pytest.mark.slow


def test_the_described_routes_never_fail_with_a_server_error(proxy: RunningProxy) -> None:
    tally = Tally()
    fuzz_openapi(proxy.url, examples=15, tally=tally)
    assert tally.cases > 50
    assert not tally.server_errors and not tally.hangs, tally.server_errors + tally.hangs
    assert tally.statuses["2xx"] and tally.statuses["4xx"]  # both valid and refused input
    assert stored_matches(proxy.database_url, tally) == (0, 0)


def test_the_completion_routes_never_fail_with_a_server_error(proxy: RunningProxy) -> None:
    tally = Tally()
    fuzz_completions(proxy.url, examples=150, tally=tally)
    assert not tally.server_errors and not tally.hangs, tally.server_errors + tally.hangs
    assert tally.statuses["4xx"] > 0
    # Exactly what was answered with a transition id is stored: refused input leaves nothing.
    assert stored_matches(proxy.database_url, tally) == (0, 0)
