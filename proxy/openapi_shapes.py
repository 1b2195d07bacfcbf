"""The JSON Schemas of the OpenAPI document (proxy/openapi.py): what the proxy answers with, and
what the completion routes read of a request.

A shape names the fields every answer has (`required`) and leaves the rest open: a field added
later is no breaking change for a client generated from it. The completion requests list only
what the proxy itself reads or refuses, with `additionalProperties: true`: everything else goes
to vLLM as it is, and vLLM's own refusals pass through unchanged.
"""

from __future__ import annotations

from typing import Any

from proxy.config import TAG_PATTERN
from proxy.relay.call import MAX_CHOICES

Schema = dict[str, Any]

STRING: Schema = {"type": "string"}
OPT_STRING: Schema = {"type": ["string", "null"]}
INTEGER: Schema = {"type": "integer"}
OPT_NUMBER: Schema = {"type": ["number", "null"]}
OPT_TIME: Schema = {"type": ["string", "null"], "format": "date-time"}
ANY_OBJECT: Schema = {"type": "object", "additionalProperties": True}


def shape(*required: str, **properties: Schema) -> Schema:
    """An object with these properties, the named ones always there, others allowed."""
    return {
        "type": "object",
        "required": list(required),
        "properties": properties,
        "additionalProperties": True,
    }


def listing(item: Schema) -> Schema:
    """`{"object": "list", "data": [...]}`, OpenAI's list shape."""
    return shape("object", "data", object={"const": "list"}, data={"type": "array", "items": item})


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


# --- errors -------------------------------------------------------------------------------------

ERROR = shape(
    "error",
    error=shape(
        "message",
        "type",
        message=STRING,
        type=STRING,
        param=OPT_STRING,
        # vLLM's errors (passed through unchanged) carry the HTTP status as an integer code.
        code={"type": ["string", "integer", "null"]},
    ),
)
ERROR["description"] = (
    "OpenAI's error shape, for the proxy's own errors and vLLM's (passed through unchanged)."
)

# --- the proxy's own answers --------------------------------------------------------------------

REWARD = shape(
    "object",
    "episode_id",
    "reward",
    "status",
    "stored",
    object={"const": "reward"},
    episode_id=STRING,
    transition_id=OPT_STRING,
    reward={"type": "number"},
    source=OPT_STRING,
    status=STRING,
    stored={"type": "boolean"},
    credited_transitions=INTEGER,
)
REWARDS_ANSWER: Schema = {
    "description": "One reward posted as an object: that reward; a list: the list shape.",
    "oneOf": [ref("Reward"), listing(ref("Reward"))],
}
DEMONSTRATION = shape(
    "object",
    "id",
    "lineage",
    "source",
    "status",
    object={"const": "demonstration"},
    id=STRING,
    lineage=STRING,
    source={"enum": ["posted", "episode"]},
    transition_id=OPT_STRING,
    status={"enum": ["created", "duplicate"]},
)
DEMONSTRATIONS_ANSWER: Schema = {
    "description": "One demonstration posted as an object: its result; a list, or from_episode "
    "(one result per call of the episode): the list shape.",
    "oneOf": [ref("Demonstration"), listing(ref("Demonstration"))],
}
TRANSITION = shape(
    "id",
    "route",
    "status",
    "requested_at",
    id=STRING,
    request_id=STRING,
    choice_index=INTEGER,
    route=STRING,
    status=STRING,
    requested_at={"type": "string", "format": "date-time"},
    messages={"type": "array"},
    text=OPT_STRING,
    policy_version={"type": ["integer", "null"]},
    prompt_token_ids={"type": ["array", "null"], "items": INTEGER},
    completion_token_ids={"type": ["array", "null"], "items": INTEGER},
    logprobs={"type": ["array", "null"], "items": {"type": "number"}},
)
EPISODE = shape(
    "id",
    "object",
    "transitions",
    "rewards",
    id=STRING,
    object={"const": "episode"},
    task_id=OPT_STRING,
    final_reward=OPT_NUMBER,
    created_at={"type": "string", "format": "date-time"},
    transitions={"type": "array", "items": ref("Transition")},
    rewards={"type": "array", "items": ANY_OBJECT},
)
PIN = {"type": ["object", "null"], "required": ["version"], "properties": {"version": INTEGER}}
ADAPTER = shape(
    "version",
    "lineage",
    "name",
    "is_current",
    version=INTEGER,
    lineage=STRING,
    name=OPT_STRING,  # null: the base model (version 0), when activated
    is_current={"type": "boolean"},
    created_at={"type": "string", "format": "date-time"},
    retired_at=OPT_TIME,
    pinned=PIN,
)
CANARY = shape(
    "id",
    "lineage",
    "candidate",
    "baseline",
    id=INTEGER,
    lineage=STRING,
    candidate=INTEGER,
    baseline=INTEGER,
    fraction={"type": "number"},
    opened_at={"type": "string", "format": "date-time"},
    decided_at=OPT_TIME,
    action=OPT_STRING,
)
LINEAGE = shape("lineage", "version", lineage=STRING, version=INTEGER, name=OPT_STRING, pinned=PIN)
UNPINNED = shape("lineage", "pinned", "was", lineage=STRING, pinned={"type": "null"}, was=PIN)
MODEL = shape("id", "object", id=STRING, object={"const": "model"}, owned_by=STRING)
# The status alone to a caller without the metrics (or admin) key while keys are on; the rest
# (always there with the key, or with keys off) names replicas, the journal and every lineage.
HEALTH = shape(
    "status",
    status={"enum": ["ok", "degraded", "failing"]},
    database=STRING,
    journal=STRING,
    policy_version=INTEGER,
    lineages={"type": "object", "additionalProperties": INTEGER},
    replicas=ANY_OBJECT,
)
WHOAMI = shape(
    "tenant",
    "admin",
    "auth",
    tenant=STRING,
    admin={"type": "boolean"},
    admin_enabled={"type": "boolean"},
    auth={"type": "boolean"},
)
EPISODE_PAGE = shape(
    "object",
    "data",
    "next",
    object={"const": "list"},
    data={"type": "array", "items": shape("id", "created_at", id=STRING, created_at=STRING)},
    next=OPT_STRING,
)
TOKENS = shape(
    "tokens",
    "total",
    tokens={
        "type": "array",
        "items": shape("id", id=INTEGER, text=OPT_STRING, logprob=OPT_NUMBER),
    },
    total=INTEGER,
    note=OPT_STRING,
)
OVERVIEW = shape("since", "until", "lineages", "canaries", "writer", writer=ANY_OBJECT)

# --- the completion routes' requests (what the proxy reads; the rest is vLLM's) ---------------

MODEL_FIELD: Schema = {
    "type": "string",
    "minLength": 1,
    "description": "A model vLLM serves, `policy` (the calling agent's lineage's current adapter), "
    "`policy@N` (version N; 0: the base model), or a provider model (FLYWHEEL_ROUTES). "
    "Missing or not a string: 400 from the proxy; a model no one serves: 404.",
}
STREAM_FIELD: Schema = {
    "type": ["boolean", "null"],
    "description": "true: the answer is `text/event-stream` (server-sent events, ending with "
    "`data: [DONE]`, or the Responses API's terminal event). Not a boolean: 400.",
}
N_FIELD: Schema = {
    "type": ["integer", "null"],
    "minimum": 1,
    "description": f"Choices per prompt; n x prompts at most {MAX_CHOICES} (each is recorded).",
}
_MESSAGE = shape("role", role=STRING)
CHAT_REQUEST = shape(
    "model",
    "messages",
    model=MODEL_FIELD,
    messages={"type": "array", "minItems": 1, "items": _MESSAGE},
    stream=STREAM_FIELD,
    n=N_FIELD | {"maximum": MAX_CHOICES},
    logprobs={"type": ["boolean", "null"]},
    tools={"type": ["array", "null"], "items": ANY_OBJECT},
)
_TOKENS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
COMPLETION_REQUEST = shape(
    "model",
    "prompt",
    model=MODEL_FIELD,
    prompt={
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            _TOKENS,
            {"type": "array", "minItems": 1, "items": _TOKENS},
        ]
    },
    stream=STREAM_FIELD,
    n=N_FIELD,
    logprobs={"type": ["integer", "null"], "minimum": 0},
)
RESPONSES_REQUEST = shape(
    "model",
    "input",
    model=MODEL_FIELD,
    input={
        "anyOf": [STRING, {"type": "array", "items": ANY_OBJECT}],
        "description": "A `function_call_output` item must follow its `function_call` in the "
        "same input (400), unless `previous_response_id` chains to the response that made it.",
    },
    instructions=OPT_STRING,
    stream=STREAM_FIELD,
    previous_response_id=OPT_STRING | {"description": "Unknown to vLLM: 404, saying why."},
    include={"type": ["array", "null"], "items": STRING},
    background={
        "enum": [False, None],
        "description": "Refused (400): vLLM returns no token ids for background responses.",
    },
)
# Each completion answer is passed through from vLLM (the proxy only strips what it added).
ANY_ARRAY: Schema = {"type": "array", "items": ANY_OBJECT}
CHAT_ANSWER = shape(
    "id", "object", "choices", id=STRING, object={"const": "chat.completion"}, choices=ANY_ARRAY
)
COMPLETION_ANSWER = shape(
    "id", "object", "choices", id=STRING, object={"const": "text_completion"}, choices=ANY_ARRAY
)
RESPONSE_ANSWER = shape("id", "object", "output", id=STRING, object={"const": "response"})
# One server-sent event (OpenAPI 3.1 reads a text/event-stream schema as each event's).
EVENT_STREAM: Schema = shape(
    "data",
    event={"type": "string", "description": "The Responses API's event type."},
    data={
        "type": "string",
        "contentMediaType": "application/json",
        "description": "A chunk or event as vLLM sends it; chat and completions end with `[DONE]`.",
    },
)
TAG: Schema = {"type": "string", "pattern": TAG_PATTERN}

# Anthropic's Messages API (proxy/relay/messages.py): what the proxy checks; the rest is
# converted as vLLM converts it (unknown fields recorded, not sent).
_BLOCK = shape("type", type=STRING)
_CONTENT: Schema = {"anyOf": [STRING, {"type": "array", "items": _BLOCK}]}
MESSAGES_REQUEST = shape(
    "model",
    "max_tokens",
    "messages",
    model=MODEL_FIELD,
    max_tokens={"type": "integer", "minimum": 1},
    messages={
        "type": "array",
        "minItems": 1,
        "items": shape(
            "role", "content", role={"enum": ["user", "assistant", "system"]}, content=_CONTENT
        ),
    },
    system={"anyOf": [STRING, {"type": "array", "items": _BLOCK}, {"type": "null"}]},
    stop_sequences={"type": ["array", "null"], "items": STRING},
    stream=STREAM_FIELD,
    tools={
        "type": ["array", "null"],
        "items": shape("name", "input_schema", name=STRING, input_schema=ANY_OBJECT),
    },
)
MESSAGE_ANSWER = shape(
    "id", "type", "role", "content", type={"const": "message"}, id=STRING, content=ANY_ARRAY
)
ANTHROPIC_ERROR = shape(
    "type",
    "error",
    type={"const": "error"},
    error=shape("type", "message", type=STRING, message=STRING),
)
