"""CrewAI: one agent, one task, one crew, its LLM at the proxy's base URL with the tags as default
headers; `litellm` in the config routes it through litellm (is_litellm=True) rather than CrewAI's
own OpenAI provider, which it picks for an `openai/` model with a custom base URL. Run by
tests/client_runs.py in the frameworks venv.

    python crewai_crew.py '{"base_url": ..., "headers": {...}, "litellm": true, "tool": true}'
"""

import json
import os
import sys

os.environ["CREWAI_DISABLE_TELEMETRY"] = "true"
os.environ["OTEL_SDK_DISABLED"] = "true"
os.environ["CREWAI_TRACING_ENABLED"] = "false"

from crewai import LLM, Agent, Crew, Task
from crewai.tools import tool

config = json.loads(sys.argv[1])
extra: dict[str, object] = (
    {"is_litellm": True, "extra_headers": config["headers"]}
    if config.get("litellm")
    else {"default_headers": config["headers"]}
)
if config.get("extra_body"):
    extra["extra_body"] = config["extra_body"]
llm = LLM(
    model="openai/" + config.get("model", "demo"),
    base_url=config["base_url"],
    api_key="x",
    max_tokens=config.get("max_tokens", 32),
    temperature=0,
    **extra,
)
cities: list[str] = []


@tool("get_weather")
def get_weather(city: str) -> str:
    """The weather in a city."""
    cities.append(city)
    return f"Sunny in {city}."


tools = [get_weather] if config.get("tool") else []
agent = Agent(role="Helper", goal="Answer", backstory="You answer.", llm=llm, tools=tools)
question = config.get("question", "What is 3 + 4?")
task = Task(description=question, expected_output="A short answer", agent=agent)
result = Crew(agents=[agent], tasks=[task], verbose=False).kickoff()
print(json.dumps({"answer": result.raw, "llm": type(llm).__name__, "cities": cities}))
