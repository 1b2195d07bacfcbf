"""The judge: rewards for episodes nobody rewarded, from an LLM that ranks a task's episodes
against each other (RULER-style), through litellm so that the judge model can be any provider's
(`openai/...`, `anthropic/...`, `hosted_vllm/...`). A process of its own (`flywheel judge`); it
reads Postgres like the trainer and posts its scores to the proxy like any application, as final
rewards with source `judge`.
"""
