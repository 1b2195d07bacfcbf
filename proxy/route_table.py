"""Every route of the proxy, declared once: `TABLE`, a `Row` per method and path.

A row says what a route is: its method and path (FastAPI's form), the module that answers it
(`router`: proxy/routes/<router>.py, or `edge` for the completion routes proxy/edge.py answers
itself), who may call it (`access`), which of a tenant's quotas it counts against (`quota`),
whether it records transitions (`records`), whether it answers under any Host name (`probe`)
and its OpenAPI answers (`doc`: error texts and schemas). Its readers:

- proxy/app.py mounts the routers, then `check_mounted`: a mounted route without a row, or a row
  without its route, stops the proxy from starting;
- proxy/edge.py authorises each request by its path's `access` and refuses a path that has no
  row before anything is done for it (it fails closed: a 404, after the key check on /v1/);
- proxy/auth.py's `require` takes the API-key scope the access names;
- proxy/quotas.py counts a request against its row's `quota`; proxy/hosts.py skips `probe`s;
- proxy/openapi.py documents every row from `doc` and the other fields.

A new route is its handler in proxy/routes/ and one row here (tests/proxy/test_route_table.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.routing import compile_path

from proxy import openapi_shapes as s
from proxy.relay import wire

# Who may call a route: an API key with that scope (keys on; infer/reward/read, /v1/ only), the
# admin key, the metrics or admin key (`ops`: /healthz answers its status to anyone), the
# dashboard's API (the admin key, or a key with `read`), or anyone.
Access = Literal["infer", "reward", "read", "admin", "ops", "dashboard", "public"]
KEY_SCOPES = ("infer", "reward", "read")
Quota = Literal["calls", "rewards", "reads"]

JSON = "application/json"
Schema = dict[str, Any]


@dataclass(frozen=True)
class Doc:
    """One operation's answers: its success (status, media type, schema) and its own errors
    (status -> when); every error body of the route (the edge's too) has the shape of
    components/schemas/`error_shape`."""

    answer: Schema | None = None  # the success body's schema (None: none documented)
    errors: dict[int, str] = field(default_factory=dict)
    status: int = 200
    media: str = JSON
    more: dict[int, Schema] = field(default_factory=dict)  # other non-error answers
    error_shape: str = "Error"
    security: list[dict[str, list[str]]] | None = None  # None: the access's (openapi.py)
    request: Schema | None = None  # the body's schema, where FastAPI does not know it (edge)


@dataclass(frozen=True)
class Row:
    method: str
    path: str  # FastAPI's form: "/ui/api/episodes/{episode_id:path}"
    router: str  # proxy/routes/<router>.py, or "edge"
    access: Access
    doc: Doc | None  # None: not in the OpenAPI document (pages, static files, the document)
    quota: Quota | None = None
    records: bool = False
    probe: bool = False  # answered under any Host name (probes, the scrape: proxy/hosts.py)

    @property
    def key(self) -> str:
        return f"{self.method} {self.path}"

    @property
    def template(self) -> str:
        """The path as OpenAPI writes it ("/ui/api/episodes/{episode_id}")."""
        return compile_path(self.path)[1]


# Statuses several routes share (the edge's own are added from the rows, openapi.py).
BODY = {
    400: "The body is empty, not JSON, or not what the route takes (`param` names the field).",
    413: "The body exceeds FLYWHEEL_MAX_BODY_BYTES.",
    415: "The body is not declared `Content-Type: application/json`.",
}
QUERY = {400: "A parameter is invalid (`param` names it)."}
DATABASE = {
    503: "Postgres is unreachable, or the read ran past FLYWHEEL_READ_TIMEOUT_S "
    "(`code: query_timeout`; the message says what to narrow)."
}
ACTIVATE = (
    QUERY
    | DATABASE
    | {
        404: "No such adapter version.",
        409: "The version is retired, or its lineage is pinned.",
        502: "A vLLM replica refused the adapter, or none answered; the alias did not move.",
    }
)
_JOURNALED = {
    "description": "Postgres unreachable or refusing: the rewards are journaled (fsync'd), "
    'with "status": "journaled" and "stored": false, and applied when the journal is replayed.',
    "content": {JSON: {"schema": s.ref("RewardsAnswer")}},
}
# The completion routes (the edge's fast lane): every agent call. vLLM's own refusals and
# answers pass through unchanged (statuses it may add, such as 500, are vLLM's, not listed).
UPSTREAM = {
    400: "Refused by the proxy (`model` or `stream` or `n` of the wrong type, a tag invalid, the "
    "body not a JSON object) or by vLLM (its validation, passed through).",
    404: "The model is not served (`policy@N`: no version N).",
    502: "vLLM unreachable, or its model list unreadable.",
    503: "`policy@N` not known to this proxy yet and Postgres unreachable to look it up.",
    504: "vLLM did not answer in time.",
}
_COMPLETION_DOCS = {
    wire.CHAT.name: Doc(
        s.CHAT_ANSWER,
        BODY
        | UPSTREAM
        | {
            400: "As above; or, for a provider model, `n` above FLYWHEEL_ROUTE_MAX_N.",
            413: "The body exceeds FLYWHEEL_MAX_BODY_BYTES, or, for a provider model, "
            "FLYWHEEL_ROUTE_MAX_BODY_BYTES.",
            429: "A provider model's rate limit (FLYWHEEL_ROUTES).",
        },
        request=s.CHAT_REQUEST,
    ),
    wire.COMPLETIONS.name: Doc(s.COMPLETION_ANSWER, BODY | UPSTREAM, request=s.COMPLETION_REQUEST),
    wire.RESPONSES.name: Doc(
        s.RESPONSE_ANSWER,
        BODY
        | UPSTREAM
        | {
            400: "As above; or `background`, an `include` not a list of strings, a "
            "`function_call_output` without its call.",
            404: "The model is not served, or vLLM does not keep `previous_response_id`.",
        },
        request=s.RESPONSES_REQUEST,
    ),
    wire.MESSAGES.name: Doc(
        s.MESSAGE_ANSWER,
        BODY | UPSTREAM | {400: "As above; or an Anthropic server tool, a block kind not served."},
        error_shape="AnthropicError",  # Anthropic's, at this route (the edge's errors too)
        security=[{"ApiKey": []}, {"AnthropicKey": []}, {}],
        request=s.MESSAGES_REQUEST,
    ),
}
_READ = QUERY | DATABASE
_ACTIVATED = Doc(s.ref("Adapter"), ACTIVATE)
_ALIVE = s.shape("status", status={"const": "alive"})

TABLE: tuple[Row, ...] = (
    *(
        Row(
            "POST",
            endpoint.path,
            "edge",
            "infer",
            _COMPLETION_DOCS[endpoint.name],
            quota="calls",
            records=True,
        )
        for endpoint in wire.ENDPOINTS
    ),
    Row(
        "POST",
        "/v1/rewards",
        "rewards",
        "reward",
        Doc(
            s.ref("RewardsAnswer"),
            BODY
            | {
                404: "A transition_id names no transition of the episode.",
                409: "A tool_call_id is ambiguous, the step was trained already, or an "
                "idempotency_key was used for another reward.",
                503: "The transitions named are not stored yet, or Postgres and the journal fail.",
            },
            more={202: _JOURNALED},
        ),
        quota="rewards",
    ),
    Row(
        "POST",
        "/v1/demonstrations",
        "demonstrations",
        "reward",  # training signal from the application, as rewards are
        Doc(
            s.ref("DemonstrationsAnswer"),
            BODY
            | {
                403: "The lineage named is another tenant's (or shared, and the caller's tenant "
                "has not opted into the shared lineages).",
                404: "from_episode names no episode (of the caller's tenant).",
                503: "Postgres unreachable: nothing was stored; repeat the post as it was.",
            },
        ),
        quota="rewards",
    ),
    Row(
        "GET",
        "/v1/episodes/{episode_id}",
        "episodes",
        "read",
        Doc(s.ref("Episode"), _READ | {404: "No such episode (of the caller's tenant)."}),
        quota="reads",
    ),
    Row(
        "GET",
        "/v1/export",
        "export",
        "read",
        Doc(
            {"type": "string", "description": "JSON Lines: one JSON object a line."},
            _READ
            | {
                429: "As many exports as the proxy allows are running (FLYWHEEL_EXPORTS_MAX), or "
                "as many of the caller's tenant as one may run (FLYWHEEL_EXPORTS_PER_TENANT)."
            },
            media="application/x-ndjson",
        ),
        quota="reads",
    ),
    Row(
        "GET",
        "/v1/models",
        "ops",
        "infer",
        Doc(s.listing(s.ref("Model")), {502: "vLLM unreachable (its other answers pass through)."}),
    ),
    Row("GET", "/admin/adapters", "admin", "admin", Doc(s.listing(s.ref("Adapter")), _READ)),
    Row("GET", "/admin/canaries", "admin", "admin", Doc(s.listing(s.ref("Canary")), _READ)),
    Row("GET", "/admin/lineages", "admin", "admin", Doc(s.listing(s.LINEAGE), DATABASE)),
    *(
        Row("POST", f"/admin/adapters/{{version}}/{verb}", "admin", "admin", _ACTIVATED)
        for verb in ("activate", "pin")
    ),
    Row("POST", "/admin/lineages/{lineage}/unpin", "admin", "admin", Doc(s.UNPINNED, _READ)),
    Row(
        "GET",
        "/healthz",
        "ops",
        "ops",
        Doc(
            s.ref("Health"),
            more={
                503: {
                    "description": "Failing: Postgres and the journal both fail (the status "
                    "alone without the metrics or admin key, as the 200).",
                    "content": {JSON: {"schema": s.ref("Health")}},
                }
            },
        ),
        probe=True,
    ),
    Row("GET", "/livez", "ops", "public", Doc(_ALIVE), probe=True),
    Row("GET", "/metrics", "ops", "ops", Doc({"type": "string"}, media="text/plain"), probe=True),
    Row("GET", "/openapi.json", "app", "public", None),  # FastAPI's; not served with keys on
    Row("GET", "/ui", "ui", "public", None),  # the dashboard's page; its API needs the keys
    Row("GET", "/ui/", "ui", "public", None),
    Row("GET", "/ui/static/{file:path}", "ui", "public", None),  # a mount, not a route
    Row("GET", "/ui/api/whoami", "ui", "dashboard", Doc(s.WHOAMI), quota="reads"),
    Row("GET", "/ui/api/overview", "ui", "dashboard", Doc(s.OVERVIEW, _READ), quota="reads"),
    Row(
        "GET",
        "/ui/api/versions",
        "ui",
        "dashboard",
        Doc(s.listing(s.ANY_OBJECT), _READ),
        quota="reads",
    ),
    Row("GET", "/ui/api/episodes", "ui", "dashboard", Doc(s.EPISODE_PAGE, _READ), quota="reads"),
    Row(
        "GET",
        "/ui/api/episodes/{episode_id:path}",
        "ui",
        "dashboard",
        Doc(s.ref("Episode"), _READ | {404: "No such episode (that the caller may see)."}),
        quota="reads",
    ),
    Row(
        "GET",
        "/ui/api/transitions/{transition_id}/tokens",
        "ui",
        "dashboard",
        Doc(s.TOKENS, _READ | {404: "No such transition (that the caller may see)."}),
        quota="reads",
    ),
)


OUTSIDE = ("edge", "app")  # rows answered outside proxy/routes/: by the edge, by FastAPI itself


class Table:
    """The rows, found by a request's method and path."""

    def __init__(self, rows: tuple[Row, ...]) -> None:
        self.rows = rows
        self._exact: dict[str, list[Row]] = {}
        self._patterns: list[tuple[re.Pattern[str], list[Row]]] = []
        by_path: dict[str, list[Row]] = {}
        for row in rows:
            by_path.setdefault(row.path, []).append(row)
        for path, same in by_path.items():
            keys = [r.key for r in same]
            if len(set(keys)) != len(keys):
                raise ValueError(f"{path} has a method twice in proxy/route_table.py")
            if len({r.access for r in same}) > 1:  # a wrong method must meet the same check
                raise ValueError(f"{path}: every method of one path needs the same access")
            if "{" in path:
                self._patterns.append((compile_path(path)[0], same))
            else:
                self._exact[path] = same

    def of_path(self, path: str) -> list[Row]:
        """Every row of the path (each of its methods); [] for a path the proxy has not."""
        rows = self._exact.get(path)
        if rows is not None:
            return rows
        for pattern, same in self._patterns:
            if pattern.match(path):
                return same
        return []

    def lookup(self, method: str, path: str) -> Row | None:
        return next((r for r in self.of_path(path) if r.method == method), None)

    def documented(self, method: str, template: str) -> Row | None:
        """The row of an operation as OpenAPI names it ("GET", "/ui/api/episodes/{episode_id}")."""
        return next((r for r in self.rows if r.method == method and r.template == template), None)

    def match(self, method: str, path: str) -> tuple[Access | None, Row | None]:
        """Who may call the path, whatever the method (a wrong one then gets the app's 405), and
        the method's row (None: the path has no row for it)."""
        rows = self.of_path(path)
        if not rows:
            return None, None
        return rows[0].access, next((r for r in rows if r.method == method), None)

    def check_mounted(self, mounted: set[tuple[str, str, str]]) -> None:
        """Stop the proxy if a mounted route (method, path, router) has no row or a row no
        route. The edge's rows are the edge's own; `app` is FastAPI's document."""
        declared = {(r.method, r.path, r.router) for r in self.rows if r.router not in OUTSIDE}
        unlisted = sorted(mounted - declared)
        unmounted = sorted(declared - mounted)
        if unlisted or unmounted:
            raise RuntimeError(
                "the proxy's routes and proxy/route_table.py disagree: "
                + "; ".join(
                    [f"{m} {p} ({r}) is mounted but has no row" for m, p, r in unlisted]
                    + [f"{m} {p} ({r}) has a row but no route" for m, p, r in unmounted]
                )
            )


ROUTES = Table(TABLE)
