"""The tool-using task's own logic (demo/calc_tools.py, demo/tool_agent.py): questions, the
calculator, the reward, and the tool exactly as vLLM renders it into the model's prompt."""

from __future__ import annotations

import re
from typing import Any

from agents.models.openai_responses import Converter
from agents.tool_context import ToolContext
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import construct_tool_dicts

from demo import calc_tools
from demo.tool_agent import CALCULATOR, EpisodeState
from proxy.config import TAG_PATTERN


def test_the_tool_reaches_the_template_as_the_warm_start_rendered_it() -> None:
    """The agent's tool, converted by the Agents SDK and then by vLLM's Responses API, is the
    dict the model was warm-started with (key order included: the template renders it as JSON)."""
    param, _ = Converter._convert_function_tool(CALCULATOR)
    request = ResponsesRequest(model="m", input="hi", tools=[param])
    rendered = construct_tool_dicts(request.tools, request.tool_choice)
    assert repr(rendered) == repr(calc_tools.rendered_tools())
    assert rendered and rendered[0]["function"]["strict"] is False  # vLLM would constrain it


def test_every_question_has_a_tag_safe_task_and_the_right_answer() -> None:
    questions = calc_tools.questions()
    assert len(questions) == len(set(questions)) == 9 * 3 * 9 * 3 * 9
    tasks = {calc_tools.task_id(q) for q in questions}
    assert len(tasks) == len(questions)
    assert all(re.fullmatch(TAG_PATTERN, t) for t in tasks)
    for q in questions:
        digits_and_ops = calc_tools.expression(q)
        assert calc_tools.answer(q) == eval(digits_and_ops)  # a test: three digits, two operators
    assert calc_tools.reward(" 11\n", "What is 3 + 4 * 2?") == 1.0
    assert calc_tools.reward("The answer is 11.", "What is 3 + 4 * 2?") == 0.0


def test_the_calculator_reads_only_its_own_expressions() -> None:
    assert calc_tools.evaluate("9 - 9 * 9") == -72
    for bad in ["3+4*2", "3 + 4 * 22", "__import__('os')", "3 + 4", "3 / 4 + 1", ""]:
        assert calc_tools.evaluate(bad) is None


async def call(arguments: str) -> tuple[str, EpisodeState]:
    state = EpisodeState("e")
    ctx: ToolContext[Any] = ToolContext(
        context=state, tool_name="calculator", tool_call_id="call_1", tool_arguments=arguments
    )
    return str(await CALCULATOR.on_invoke_tool(ctx, arguments)), state


async def test_the_agent_s_tool_counts_good_runs_and_remembers_failed_ones() -> None:
    out, state = await call('{"expression": "3 + 4 * 2"}')
    assert out == "11" and state.valid_calls == 1 and state.failed_calls == []
    for bad in ['{"expression": "3+4"}', '{"expr": "3 + 4 * 2"}', "[]", "{"]:
        out, state = await call(bad)
        assert out.startswith("error") and state.failed_calls == ["call_1"], bad
