"""DSPy: a `Predict` module (or, with `react`, a `ReAct` agent with a tool) through its LM
client: litellm's OpenAI provider at the proxy's base URL, the tags as litellm's extra_headers.
Run by tests/client_runs.py in the frameworks venv.

    python dspy_predict.py '{"base_url": ..., "headers": {...}, "extra_body": {...}}'
"""

import json
import sys

import dspy

config = json.loads(sys.argv[1])
lm = dspy.LM(
    "openai/" + config.get("model", "demo"),
    api_base=config["base_url"],
    api_key="x",
    max_tokens=config.get("max_tokens", 32),
    temperature=0,
    cache=False,
    extra_headers=config["headers"],
    extra_body=config.get("extra_body"),
)
cities: list[str] = []


def get_weather(city: str) -> str:
    """The weather in a city."""
    cities.append(city)
    return f"Sunny in {city}."


with dspy.context(lm=lm):
    if config.get("react"):  # DSPy's agent: its tool calls are fields of its text format
        module = dspy.ReAct("question -> answer", tools=[get_weather], max_iters=2)
        prediction = module(question="What is the weather in Paris?")
    else:
        prediction = dspy.Predict("question -> answer")(question="What is 3 + 4?")
print(json.dumps({"answer": prediction.answer, "history": len(lm.history), "cities": cities}))
