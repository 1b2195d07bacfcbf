"""The OpenAPI document of the whole API (`/openapi.json`, served without keys: app.py).

FastAPI generates what its router serves; `document(app)` adds what it cannot see:

- the completion routes, which the edge answers outside FastAPI (`wire.ENDPOINTS`): their
  request schema, the JSON answer or its `text/event-stream` for `stream: true`, the tag headers
  and the answer's `X-*` headers (`COMPLETIONS`, a row per endpoint);
- every operation's answers and error statuses (`ROUTES`, a row per FastAPI route): the errors in
  OpenAI's shape (the `Error` component), the 400 the app answers for an invalid parameter (not
  FastAPI's 422), the 202 of a journaled reward;
- what the edge adds to every route, from the edge's own rules: the 421 of the Host check (not on
  the probes), the 429 of a tenant's quota (with `Retry-After`: proxy/quotas.py), the keys
  (security schemes `ApiKey`, `AdminKey` and `MetricsKey`, with their 401 and 403), and for
  `/v1/` paths the path form of the base URL (`/episode/{episode}/task/{task}/agent/{agent}`),
  described as a server: it is a prefix of the base URL, not a route of its own.

A route without a row fails the build (tests/test_openapi.py builds it): a new route is one more
row here (a completion API with errors of another shape, Anthropic's, names its own component in
`error_shape`, and its key header in `security`). The JSON Schemas are in openapi_shapes.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from proxy import openapi_shapes as s
from proxy.auth import OPS_PATHS
from proxy.hosts import ANY_NAME_PATHS
from proxy.relay import wire
from proxy.relay.tags import HEADERS, PATH_KEYS

JSON = "application/json"
Schema = dict[str, Any]


@dataclass(frozen=True)
class Route:
    """One operation's answers: its success (status, media type, schema) and its own errors
    (status -> when); every error body of the route (the edge's too) has the shape of
    components/schemas/`error_shape`."""

    answer: Schema | None = None  # the success body's schema (None: none documented)
    errors: dict[int, str] = field(default_factory=dict)
    status: int = 200
    media: str = JSON
    more: dict[int, Schema] = field(default_factory=dict)  # other non-error answers
    error_shape: str = "Error"
    security: list[dict[str, list[str]]] | None = None  # None: the path's (`_security`)


# Statuses several routes share (the edge's own are added from its rules, see `_edge_errors`).
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

ROUTES: dict[str, Route] = {
    "POST /v1/rewards": Route(
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
    "POST /v1/demonstrations": Route(
        s.ref("DemonstrationsAnswer"),
        BODY
        | {
            403: "The lineage named is another tenant's (or shared, and the caller's tenant "
            "has not opted into the shared lineages).",
            404: "from_episode names no episode (of the caller's tenant).",
            503: "Postgres unreachable: nothing was stored; repeat the post as it was.",
        },
    ),
    "GET /v1/episodes/{episode_id}": Route(
        s.ref("Episode"), QUERY | DATABASE | {404: "No such episode (of the caller's tenant)."}
    ),
    "GET /v1/export": Route(
        {"type": "string", "description": "JSON Lines: one JSON object a line."},
        QUERY
        | DATABASE
        | {
            429: "As many exports as the proxy allows are running (FLYWHEEL_EXPORTS_MAX), or "
            "as many of the caller's tenant as one may run (FLYWHEEL_EXPORTS_PER_TENANT)."
        },
        media="application/x-ndjson",
    ),
    "GET /v1/models": Route(
        s.listing(s.ref("Model")), {502: "vLLM unreachable (its other answers pass through)."}
    ),
    "GET /admin/adapters": Route(s.listing(s.ref("Adapter")), QUERY | DATABASE),
    "GET /admin/canaries": Route(s.listing(s.ref("Canary")), QUERY | DATABASE),
    "GET /admin/lineages": Route(s.listing(s.LINEAGE), DATABASE),
    "POST /admin/adapters/{version}/activate": Route(s.ref("Adapter"), ACTIVATE),
    "POST /admin/adapters/{version}/pin": Route(s.ref("Adapter"), ACTIVATE),
    "POST /admin/lineages/{lineage}/unpin": Route(s.UNPINNED, QUERY | DATABASE),
    "GET /healthz": Route(
        s.ref("Health"),
        more={
            503: {
                "description": "Failing: Postgres and the journal both fail (the status alone "
                "without the metrics or admin key, as the 200).",
                "content": {JSON: {"schema": s.ref("Health")}},
            }
        },
    ),
    "GET /livez": Route(s.shape("status", status={"const": "alive"})),
    "GET /metrics": Route({"type": "string"}, media="text/plain"),
    "GET /ui/api/whoami": Route(s.WHOAMI),
    "GET /ui/api/overview": Route(s.OVERVIEW, QUERY | DATABASE),
    "GET /ui/api/versions": Route(s.listing(s.ANY_OBJECT), QUERY | DATABASE),
    "GET /ui/api/episodes": Route(s.EPISODE_PAGE, QUERY | DATABASE),
    "GET /ui/api/episodes/{episode_id}": Route(
        s.ref("Episode"), QUERY | DATABASE | {404: "No such episode (that the caller may see)."}
    ),
    "GET /ui/api/transitions/{transition_id}/tokens": Route(
        s.TOKENS, QUERY | DATABASE | {404: "No such transition (that the caller may see)."}
    ),
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
COMPLETIONS: dict[str, tuple[Schema, Route]] = {
    wire.CHAT.name: (
        s.CHAT_REQUEST,
        Route(
            s.CHAT_ANSWER,
            BODY
            | UPSTREAM
            | {
                400: "As above; or, for a provider model, `n` above FLYWHEEL_ROUTE_MAX_N.",
                413: "The body exceeds FLYWHEEL_MAX_BODY_BYTES, or, for a provider model, "
                "FLYWHEEL_ROUTE_MAX_BODY_BYTES.",
                429: "A provider model's rate limit (FLYWHEEL_ROUTES).",
            },
        ),
    ),
    wire.COMPLETIONS.name: (s.COMPLETION_REQUEST, Route(s.COMPLETION_ANSWER, BODY | UPSTREAM)),
    wire.RESPONSES.name: (
        s.RESPONSES_REQUEST,
        Route(
            s.RESPONSE_ANSWER,
            BODY
            | UPSTREAM
            | {
                400: "As above; or `background`, an `include` not a list of strings, a "
                "`function_call_output` without its call.",
                404: "The model is not served, or vLLM does not keep `previous_response_id`.",
            },
        ),
    ),
    wire.MESSAGES.name: (
        s.MESSAGES_REQUEST,
        Route(
            s.MESSAGE_ANSWER,
            BODY
            | UPSTREAM
            | {400: "As above; or an Anthropic server tool, a block kind not served."},
            error_shape="AnthropicError",  # Anthropic's, at this route (the edge's errors too)
            security=[{"ApiKey": []}, {"AnthropicKey": []}, {}],
        ),
    ),
}
# The edge's 429s (proxy/quotas.py), by path; the reads' are every /v1/episodes/ and /ui/api/ path.
_CALL_QUOTA = (
    "Over the tenant's quota of completion calls per second or in flight (FLYWHEEL_QUOTA_*, "
    "FLYWHEEL_TENANT_QUOTAS); nothing was forwarded or recorded."
)
QUOTA_PATHS = {endpoint.path: _CALL_QUOTA for endpoint in wire.ENDPOINTS} | {
    "/v1/rewards": "Over the tenant's quota of reward posts per second; nothing was stored.",
    "/v1/export": "Over the tenant's quota of reads per second.",
}
RETRY_AFTER = {
    "description": "Whole seconds until the tenant's quota lets a request through again (sent "
    "with the quota's 429s).",
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
}
COMPONENTS: dict[str, Schema] = {
    "Error": s.ERROR,
    "AnthropicError": s.ANTHROPIC_ERROR,
    "Reward": s.REWARD,
    "RewardsAnswer": s.REWARDS_ANSWER,
    "Demonstration": s.DEMONSTRATION,
    "DemonstrationsAnswer": s.DEMONSTRATIONS_ANSWER,
    "Episode": s.EPISODE,
    "Transition": s.TRANSITION,
    "Adapter": s.ADAPTER,
    "Canary": s.CANARY,
    "Model": s.MODEL,
    "Health": s.HEALTH,
}
SECURITY_SCHEMES = {
    "ApiKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "A key of FLYWHEEL_API_KEYS or made by `flywheel keys create` (a "
        "tenant's, with scopes). Needed only when keys are on (then this document is not "
        "served: `app.openapi()` builds it).",
    },
    "AdminKey": {"type": "http", "scheme": "bearer", "description": "FLYWHEEL_ADMIN_KEY."},
    "MetricsKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "FLYWHEEL_METRICS_KEY (Prometheus' scrape), or the admin key: /metrics "
        "and /healthz's detail while keys are on (or it is set). Without it /healthz answers "
        "its status alone, for the probes; with keys off and no metrics key, both are open.",
    },
    "AnthropicKey": {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "An API key as Anthropic's SDK sends it (`/v1/messages` only).",
    },
}
PATH_FORM = {
    "url": "/episode/{episode}/task/{task}/agent/{agent}",
    "description": "The path form of the base URL, for clients that can set only a base URL: "
    "the tags as `/key/value` pairs before `/v1`, any subset in any order (the completion "
    "routes read them; the other `/v1/` routes accept and ignore them).",
    "variables": {key: {"default": key[0] + "1"} for key in PATH_KEYS},
}
DESCRIPTION = (
    "An OpenAI-compatible proxy in front of vLLM that records every completion call (one "
    "transition per choice) for training, and takes rewards for them. The completion routes "
    "forward everything in the body to vLLM; vLLM's answers and errors pass through unchanged. "
    "Every error has OpenAI's shape (`Error`), but those of `/v1/messages`: Anthropic's "
    "(`AnthropicError`)."
)


def document(app: FastAPI) -> dict[str, Any]:
    """The whole API's OpenAPI document (cached on the app, as FastAPI caches its own)."""
    if app.openapi_schema is None:
        doc = get_openapi(
            title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes
        )
        for path, operations in doc["paths"].items():
            for method, operation in operations.items():
                row = ROUTES.get(f"{method.upper()} {path}")
                if row is None:
                    raise LookupError(f"{method.upper()} {path} has no row in proxy/openapi.py")
                _describe(operation, path, row)
        for endpoint in wire.ENDPOINTS:
            if endpoint.name not in COMPLETIONS:
                raise LookupError(f"POST {endpoint.path} has no row in proxy/openapi.py")
            request, row = COMPLETIONS[endpoint.name]
            doc["paths"][endpoint.path] = {"post": _completion(endpoint, request, row)}
        for path, operations in doc["paths"].items():
            if path.startswith("/v1/"):
                operations["servers"] = [{"url": "/"}, PATH_FORM]
        components = doc.setdefault("components", {})
        components["schemas"] = COMPONENTS  # FastAPI's (its 422 shapes) are not answered
        components["securitySchemes"] = SECURITY_SCHEMES
        app.openapi_schema = doc
    return app.openapi_schema


def _describe(operation: dict[str, Any], path: str, row: Route) -> None:
    responses: dict[str, Any] = {}
    content = {row.media: {"schema": row.answer}} if row.answer is not None else {}
    responses[str(row.status)] = {"description": "OK", "content": content}
    responses |= {str(k): v for k, v in row.more.items()}
    responses |= _errors(path, row)
    operation["responses"] = responses
    security = row.security or _security(path)
    if security is not None:
        operation["security"] = security


def _completion(endpoint: wire.Endpoint, request: Schema, row: Route) -> dict[str, Any]:
    headers = {
        name: {"schema": s.STRING, "required": True}
        for name in ("X-Episode-Id", "X-Transition-Id", "X-Policy-Version", "X-Policy-Lineage")
    }
    ok = {
        "description": "vLLM's answer, recorded (one transition per choice); with "
        "`stream: true` server-sent events.",
        "headers": headers,
        "content": {JSON: {"schema": row.answer}, "text/event-stream": {"schema": s.EVENT_STREAM}},
    }
    tags = [
        {
            "name": header.title(),  # X-Episode-Id
            "in": "header",
            "required": False,
            "schema": s.TAG,
            "description": f"The call's {name} (or in the path form of the base URL).",
        }
        for name, header in HEADERS.items()
    ]
    return {
        "summary": f"{endpoint.name}: forwarded to vLLM and recorded",
        "operationId": f"create_{endpoint.name}",
        "parameters": tags,
        "requestBody": {"required": True, "content": {JSON: {"schema": request}}},
        "responses": {"200": ok} | _errors(endpoint.path, row),
        "security": row.security or _security(endpoint.path),
    }


def _errors(path: str, row: Route) -> dict[str, Any]:
    """The route's own errors and the edge's, one response per status."""
    whys: dict[int, list[str]] = {}
    for table in (row.errors, _edge_errors(path)):
        for status, why in table.items():
            whys.setdefault(status, []).append(why)
    answers: dict[str, Any] = {
        str(status): {
            "description": " ".join(whys[status]),
            "content": {JSON: {"schema": s.ref(row.error_shape)}},
        }
        for status in sorted(whys)
    }
    if "429" in answers:
        answers["429"]["headers"] = {"Retry-After": RETRY_AFTER}
    return answers


def _edge_errors(path: str) -> dict[int, str]:
    """What edge.py answers before a route sees the request."""
    errors = {} if path in ANY_NAME_PATHS else {421: "The Host is not one this proxy answers to."}
    if path.startswith(("/v1/", "/ui/api/")):
        errors[401] = "No valid key (keys are on)."
        errors[403] = "The key lacks the scope the route needs."
    if path.startswith("/v1/"):
        errors[404] = "A path-form tag key that is not episode, task or agent."
        errors[400] = "A path-form tag twice."
    if path in QUOTA_PATHS or path.startswith(("/v1/episodes/", "/ui/api/")):
        errors[429] = QUOTA_PATHS.get(path, "Over the tenant's quota of reads per second.")
    if path.startswith("/admin/"):
        errors[401] = "No valid admin key."
        errors[403] = "Admin endpoints are off (FLYWHEEL_ADMIN_KEY unset)."
    if path in OPS_PATHS:
        errors[401] = (
            "No valid metrics or admin key (keys on, or FLYWHEEL_METRICS_KEY set)."
            if path == "/metrics"
            else "A key that is not the metrics or admin key (without one: the status alone)."
        )
        errors[403] = "Keys are on and neither FLYWHEEL_METRICS_KEY nor FLYWHEEL_ADMIN_KEY is set."
    return errors


def _security(path: str) -> list[dict[str, list[str]]] | None:
    if path.startswith("/v1/"):
        return [{"ApiKey": []}, {}]  # {}: a proxy without keys
    if path.startswith("/ui/api/"):
        return [{"ApiKey": []}, {"AdminKey": []}, {}]
    if path.startswith("/admin/"):
        return [{"AdminKey": []}]
    if path in OPS_PATHS:
        return [{"MetricsKey": []}, {"AdminKey": []}, {}]  # {}: keys off (/healthz: its status)
    return None
