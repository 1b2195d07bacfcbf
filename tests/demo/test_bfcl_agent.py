"""The BFCL agent's own bookkeeping (demo/bfcl_agent.py), on the real proxy and the fake vLLM:
rejection sampling copies exactly its valid answers' calls as demonstrations, once each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from core import evals
from demo import bfcl
from demo.bfcl_agent import AGENT, Answer, BfclAgent, every_tenth
from tests.conftest import RunningProxy

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_keep_the_best_copies_the_valid_answers_calls_once(proxy: RunningProxy) -> None:
    for episode in ("good", "bad"):
        with proxy.client(**{"X-Episode-Id": episode, "X-Agent-Name": AGENT}) as c:
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    proxy.wait_rows("SELECT 1 FROM transition", 2)
    agent = BfclAgent(proxy.url)
    try:
        answers = [
            Answer("q1", "[f(a=1)]", True, True, 1.0, 1.0, "0", episode_id="good"),
            Answer("q1", "f(a=", False, False, 0.0, 0.0, "0", episode_id="bad"),
            Answer("q2", "", True, True, 1.0, 1.0, "0", failed="lost", episode_id=""),
        ]
        assert agent.keep_the_best(answers) == 1
        assert agent.keep_the_best(answers) == 0  # copied once
    finally:
        agent.close()
    copied = proxy.query("SELECT episode_id, source FROM demonstration")
    assert copied == [("good", "episode")], copied


def test_bfcl_as_an_eval_set_of_training_questions(tmp_path: Path) -> None:
    """`python -m demo.bfcl eval-set` writes training-part questions that `flywheel eval add`
    accepts with BFCL's scorer, which gives a demonstrated answer 1 and prose 0."""
    out = tmp_path / "bfcl.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "demo.bfcl", "eval-set", str(out), "--questions", "20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    items = evals.read_items(out.read_bytes().splitlines(), out.name)
    evals.check("python:demo.bfcl:eval_score", items)
    train, _ = bfcl.split(bfcl.load())
    assert len(items) == 20
    assert {i["reference"]["id"] for i in items} <= {q.id for q in train}  # never held out
    score = evals.scorer("python:demo.bfcl:eval_score")
    by_id = {q.id: q for q in train}
    for item in items[:5]:
        q = by_id[item["reference"]["id"]]
        assert score({"content": bfcl.demonstration(q)}, item) == 1.0
        assert score({"content": "To compute this, use the formula."}, item) == 0.0


def test_an_evaluation_reports_its_progress(proxy: RunningProxy) -> None:
    """The first screen of `flywheel up --task bfcl` is not silent while the base model is
    asked: a line for every tenth of the questions answered, the last one at the end."""
    agent = BfclAgent(proxy.url)
    lines: list[str] = []
    try:
        asked = agent.held_out[:20]
        result = agent.evaluate(0, asked, progress=every_tenth(lines.append))
    finally:
        agent.close()
    assert result.questions == 20
    assert len(lines) == 10, lines
    assert [line.split()[1] for line in lines] == [f"{n}/20" for n in range(2, 21, 2)]
    assert lines[-1].startswith("  held-out 20/20 answered: ")
    assert f"{round(result.accuracy * 20)} valid" in lines[-1]
