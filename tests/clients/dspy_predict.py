"""DSPy: a `Predict` module through its LM client (litellm's OpenAI provider at the proxy's base
URL, the tags as litellm's extra_headers). Run by tests/client_runs.py in the frameworks venv.

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
with dspy.context(lm=lm):
    prediction = dspy.Predict("question -> answer")(question="What is 3 + 4?")
print(json.dumps({"answer": prediction.answer, "history": len(lm.history)}))
