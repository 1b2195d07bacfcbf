"""LlamaIndex: `OpenAILike` (llama-index-llms-openai-like) at the proxy's base URL, the tags as
default headers: a chat, a streamed chat and a chat with a tool. Run by tests/client_runs.py in
the frameworks venv.

    python llamaindex_chat.py '{"base_url": ..., "headers": {...}, "mode": "chat|stream|tool"}'
"""

import json
import sys

from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike

config = json.loads(sys.argv[1])
llm = OpenAILike(
    model=config.get("model", "demo"),
    api_base=config["base_url"],
    api_key="x",
    max_tokens=config.get("max_tokens", 8),
    default_headers=config["headers"],
    additional_kwargs={"extra_body": config["extra_body"]} if config.get("extra_body") else {},
    is_chat_model=True,
    is_function_calling_model=True,
    timeout=120,
)
question = config.get("question", "What is 3 + 4?")
out: dict[str, object] = {}
if config["mode"] == "chat":
    out["text"] = llm.chat([ChatMessage(role="user", content=question)]).message.content
elif config["mode"] == "stream":
    chunks = list(llm.stream_chat([ChatMessage(role="user", content=question)]))
    out["text"] = chunks[-1].message.content
    out["deltas"] = len(chunks)
else:

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}."

    tool = FunctionTool.from_defaults(fn=get_weather)
    response = llm.chat_with_tools(
        [tool], user_msg=question, tool_required=config.get("tool_required", True)
    )
    calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    out["calls"] = [
        {"id": call.tool_id, "name": call.tool_name, "arguments": call.tool_kwargs}
        for call in calls
    ]
print(json.dumps(out))
