"""Which episode, task and agent a call belongs to: from headers, or from the path.

Path form, for clients that can only set a base URL: `/{key}/{value}` pairs before `/v1`, any
subset, any order, e.g. `/episode/e42/task/t7/agent/planner/v1/chat/completions`.
A call without an episode id is its own one-call episode with a generated id.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from core.tenants import DEFAULT, Principal
from proxy.config import TAG_PATTERN
from proxy.errors import ApiError

_VALID = re.compile(TAG_PATTERN)
PATH_KEYS = {"episode": "episode_id", "task": "task_id", "agent": "agent_name"}
HEADERS = {"episode_id": "x-episode-id", "task_id": "x-task-id", "agent_name": "x-agent-name"}


@dataclass(frozen=True)
class Tags:
    episode_id: str  # as stored: `<tenant>/<id>` for a tenant's key (core/tenants.py)
    task_id: str | None = None  # likewise
    agent_name: str | None = None
    generated: bool = False  # no episode id was given: this call is an episode of its own
    public_episode_id: str = ""  # as the client named it (X-Episode-Id in the answer)
    tenant: str | None = None  # whose call it is (None: the default tenant)


def split_path(path: str) -> tuple[dict[str, str], str] | None:
    """`/episode/e1/task/t/v1/x` -> ({"episode_id": "e1", "task_id": "t"}, "/v1/x").

    None when the path has no tag prefix. Raises ApiError for a malformed prefix.
    """
    head, sep, tail = path.partition("/v1/")
    if not sep or head in ("", "/"):
        return None
    parts = head.strip("/").split("/")
    if len(parts) % 2:
        raise ApiError(404, f"Unknown path {path!r}: tags go in /key/value pairs before /v1")
    tags: dict[str, str] = {}
    for key, value in zip(parts[::2], parts[1::2], strict=True):
        name = PATH_KEYS.get(key)
        if name is None:
            raise ApiError(
                404, f"Unknown tag key {key!r} in path: use episode, task or agent", code="bad_tag"
            )
        if name in tags:
            raise ApiError(400, f"tag {key!r} appears twice in the path", code="bad_tag")
        tags[name] = value  # the server decoded the path once already; never twice
    return tags, "/v1/" + tail


def resolve(
    path_tags: dict[str, str], headers: dict[str, str], principal: Principal = DEFAULT
) -> Tags:
    values: dict[str, str] = {}
    for name, header in HEADERS.items():
        from_header = headers.get(header)
        from_path = path_tags.get(name)
        if from_header is not None and from_path is not None and from_header != from_path:
            raise ApiError(
                400,
                f"{name} differs between the path ({from_path!r}) and {header} ({from_header!r})",
                param=name,
                code="bad_tag",
            )
        value = from_header if from_header is not None else from_path
        if value is None:
            continue
        if not _VALID.fullmatch(value):  # `$` alone would let a trailing newline through
            raise ApiError(
                400,
                f"invalid {name} {value[:80]!r}: 1-200 characters of letters, digits and ._:@+=-, "
                "starting with a letter or digit",
                param=name,
                code="bad_tag",
            )
        values[name] = value
    generated = "episode_id" not in values
    if generated:
        values["episode_id"] = f"ep-{uuid.uuid4().hex}"
    task_id = values.get("task_id")
    return Tags(
        episode_id=principal.own(values["episode_id"]),
        task_id=principal.own(task_id) if task_id is not None else None,
        agent_name=values.get("agent_name"),
        generated=generated,
        public_episode_id=values["episode_id"],
        tenant=principal.tenant,
    )
