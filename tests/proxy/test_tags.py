"""Tag parsing: headers, the path form, and what is refused."""

from __future__ import annotations

import pytest

from proxy.errors import ApiError
from proxy.relay.tags import resolve, split_path


def test_path_pairs_any_order_any_subset() -> None:
    tags, rest = split_path("/agent/planner/episode/e42/v1/chat/completions") or ({}, "")
    assert tags == {"agent_name": "planner", "episode_id": "e42"}
    assert rest == "/v1/chat/completions"


def test_plain_path_has_no_tags() -> None:
    assert split_path("/v1/chat/completions") is None


@pytest.mark.parametrize(
    "path", ["/episode/v1/chat/completions", "/colour/red/v1/models", "/task/a/task/b/v1/models"]
)
def test_malformed_path_tags_are_refused(path: str) -> None:
    with pytest.raises(ApiError):
        split_path(path)


def test_header_and_path_must_agree() -> None:
    with pytest.raises(ApiError) as e:
        resolve({"episode_id": "a"}, {"x-episode-id": "b"})
    assert e.value.status == 400


def test_bad_values_are_refused_and_missing_episode_is_generated() -> None:
    with pytest.raises(ApiError):
        resolve({}, {"x-task-id": "has space"})
    with pytest.raises(ApiError):
        resolve({}, {"x-agent-name": "x" * 201})
    tags = resolve({}, {"x-task-id": "t1"})
    assert tags.episode_id.startswith("ep-") and tags.task_id == "t1"


def test_values_match_whole_and_the_path_is_not_decoded_again() -> None:
    for bad in ("e\n", "e\r\n", "\ne"):
        with pytest.raises(ApiError):
            resolve({}, {"x-episode-id": bad})
    # The server hands over the path decoded once; a "%" left in it stays (and is refused).
    tags, rest = split_path("/episode/e%0A/v1/x") or ({}, "")
    assert tags == {"episode_id": "e%0A"} and rest == "/v1/x"
    with pytest.raises(ApiError):
        resolve(tags, {})
