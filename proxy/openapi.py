"""The OpenAPI document of the whole API (`/openapi.json`, served without keys: app.py).

FastAPI generates what its router serves; `document(app)` adds, from each route's row in
proxy/route_table.py (its `doc`, `access` and `quota`), what it cannot see:

- the completion routes, which the edge answers outside FastAPI (`wire.ENDPOINTS`): their
  request schema, the JSON answer or its `text/event-stream` for `stream: true`, the tag headers
  and the answer's `X-*` headers;
- every operation's answers and error statuses: the errors in OpenAI's shape (the `Error`
  component; Anthropic's at `/v1/messages`), the 400 the app answers for an invalid parameter
  (not FastAPI's 422), the 202 of a journaled reward;
- what the edge adds to every route, from its row: the 421 of the Host check (not on the
  probes), the 429 of a tenant's quota (with `Retry-After`: proxy/quotas.py), the keys (security
  schemes `ApiKey`, `AdminKey` and `MetricsKey`, with their 401 and 403), and for `/v1/` paths
  the path form of the base URL (`/episode/{episode}/task/{task}/agent/{agent}`), described as a
  server: it is a prefix of the base URL, not a route of its own.

A documented route without a row (or whose row has no `doc`) fails the build
(tests/proxy/test_openapi.py builds it). The JSON Schemas are in openapi_shapes.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from proxy import openapi_shapes as s
from proxy import route_table
from proxy.relay import wire
from proxy.relay.tags import HEADERS, PATH_KEYS
from proxy.route_table import JSON, KEY_SCOPES, Row

Schema = dict[str, Any]


# The edge's 429s (proxy/quotas.py), by the quota a route's row names.
QUOTA_ERRORS = {
    "calls": "Over the tenant's quota of completion calls per second or in flight "
    "(FLYWHEEL_QUOTA_*, FLYWHEEL_TENANT_QUOTAS); nothing was forwarded or recorded.",
    "rewards": "Over the tenant's quota of reward posts per second; nothing was stored.",
    "reads": "Over the tenant's quota of reads per second.",
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
                row = route_table.ROUTES.documented(method.upper(), path)
                if row is None or row.doc is None:
                    raise LookupError(f"{method.upper()} {path} has no doc in proxy/route_table.py")
                _describe(operation, row)
        for endpoint in wire.ENDPOINTS:
            row = route_table.ROUTES.lookup("POST", endpoint.path)
            if row is None or row.doc is None or row.doc.request is None:
                raise LookupError(f"POST {endpoint.path} has no doc in proxy/route_table.py")
            doc["paths"][endpoint.path] = {"post": _completion(endpoint, row)}
        for path, operations in doc["paths"].items():
            if path.startswith("/v1/"):
                operations["servers"] = [{"url": "/"}, PATH_FORM]
        components = doc.setdefault("components", {})
        components["schemas"] = COMPONENTS  # FastAPI's (its 422 shapes) are not answered
        components["securitySchemes"] = SECURITY_SCHEMES
        app.openapi_schema = doc
    return app.openapi_schema


def _describe(operation: dict[str, Any], row: Row) -> None:
    assert row.doc is not None
    d = row.doc
    responses: dict[str, Any] = {}
    content = {d.media: {"schema": d.answer}} if d.answer is not None else {}
    responses[str(d.status)] = {"description": "OK", "content": content}
    responses |= {str(k): v for k, v in d.more.items()}
    responses |= _errors(row)
    operation["responses"] = responses
    security = d.security or _security(row)
    if security is not None:
        operation["security"] = security


def _completion(endpoint: wire.Endpoint, row: Row) -> dict[str, Any]:
    assert row.doc is not None
    headers = {
        name: {"schema": s.STRING, "required": True}
        for name in ("X-Episode-Id", "X-Transition-Id", "X-Policy-Version", "X-Policy-Lineage")
    }
    ok = {
        "description": "vLLM's answer, recorded (one transition per choice); with "
        "`stream: true` server-sent events.",
        "headers": headers,
        "content": {
            JSON: {"schema": row.doc.answer},
            "text/event-stream": {"schema": s.EVENT_STREAM},
        },
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
        "requestBody": {"required": True, "content": {JSON: {"schema": row.doc.request}}},
        "responses": {"200": ok} | _errors(row),
        "security": row.doc.security or _security(row),
    }


def _errors(row: Row) -> dict[str, Any]:
    """The route's own errors and the edge's, one response per status."""
    assert row.doc is not None
    whys: dict[int, list[str]] = {}
    for table in (row.doc.errors, _edge_errors(row)):
        for status, why in table.items():
            whys.setdefault(status, []).append(why)
    answers: dict[str, Any] = {
        str(status): {
            "description": " ".join(whys[status]),
            "content": {JSON: {"schema": s.ref(row.doc.error_shape)}},
        }
        for status in sorted(whys)
    }
    if "429" in answers:
        answers["429"]["headers"] = {"Retry-After": RETRY_AFTER}
    return answers


def _edge_errors(row: Row) -> dict[int, str]:
    """What edge.py answers before a route sees the request, from the route's row."""
    errors = {} if row.probe else {421: "The Host is not one this proxy answers to."}
    if row.access in KEY_SCOPES or row.access == "dashboard":
        errors[401] = "No valid key (keys are on)."
        errors[403] = "The key lacks the scope the route needs."
    if row.path.startswith("/v1/"):
        errors[404] = "A path-form tag key that is not episode, task or agent."
        errors[400] = "A path-form tag twice."
    if row.quota is not None:
        errors[429] = QUOTA_ERRORS[row.quota]
    if row.access == "admin":
        errors[401] = "No valid admin key."
        errors[403] = "Admin endpoints are off (FLYWHEEL_ADMIN_KEY unset)."
    if row.access == "ops":
        errors[401] = (
            "No valid metrics or admin key (keys on, or FLYWHEEL_METRICS_KEY set)."
            if row.path == "/metrics"
            else "A key that is not the metrics or admin key (without one: the status alone)."
        )
        errors[403] = "Keys are on and neither FLYWHEEL_METRICS_KEY nor FLYWHEEL_ADMIN_KEY is set."
    return errors


def _security(row: Row) -> list[dict[str, list[str]]] | None:
    if row.access in KEY_SCOPES:
        return [{"ApiKey": []}, {}]  # {}: a proxy without keys
    if row.access == "dashboard":
        return [{"ApiKey": []}, {"AdminKey": []}, {}]
    if row.access == "admin":
        return [{"AdminKey": []}]
    if row.access == "ops":
        return [{"MetricsKey": []}, {"AdminKey": []}, {}]  # {}: keys off (/healthz: its status)
    return None
