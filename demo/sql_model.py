"""The model of the SQL task (issue 12): the tiny Qwen2 of demo/tiny_model.py, warm-started on CPU
(full-weight supervised, deterministic) so that each agent plays its part *sometimes* right, and
RL has something to find in each.

    writer    the gold query with probability P_WRITER_RIGHT, else one of the template's
              MISTAKES. Some mistakes fail loudly (an error, no rows, a lone 0 or NULL: the
              checker objects and the rewriter gets a chance), others run and return the wrong
              rows (the checker approves, the episode scores 0): only the writer can unlearn those.
    checker   "ok" or "wrong" by sql_env.looks_wrong on the result it is shown, flipped with
              probability P_CHECKER_FLIP. Not trained: it stays on the base model.
    rewriter  shown a query the checker objected to: the gold query with probability
              P_REWRITER_RIGHT, else another of the template's mistakes.

The question space is small (26 questions), so the model learns each question's distribution
rather than to copy values: the point is the machinery (three agents, two lineages), not SQL.
Measured figures are written next to the weights (`warm_start.json`).

    python -m demo.sql_model DIR      # build the model into DIR (idempotent)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from demo import sql_env, warm_start
from demo.sql_env import checker_messages, rewriter_messages, writer_messages
from demo.tiny_model import build_tokenizer, one_build_at_a_time
from demo.warm_start import pad_rows, sample_texts, token_logprobs

# Per template: wrong queries ({v}: the question's value). Each says which way it fails.
MISTAKES: dict[str, tuple[str, ...]] = {
    "count_city": (
        "SELECT COUNT(*) FROM emp WHERE dept = '{v}'",  # 0: objected to
        "SELECT COUNT(*) FROM emp WHERE city = {v}",  # error
        "SELECT MAX(pay) FROM emp WHERE city = '{v}'",  # runs, wrong
    ),
    "names_city": (
        "SELECT name FROM emp WHERE dept = '{v}'",  # no rows
        "SELECT name FROM emp WHERE city = {v}",  # error
        "SELECT name FROM emp",  # runs, wrong
    ),
    "top_pay": (
        "SELECT MAX(pay) FROM emp WHERE city = '{v}'",  # NULL
        "SELECT MAX(pay) FROM emp WHERE dept = {v}",  # error
        "SELECT MIN(pay) FROM emp WHERE dept = '{v}'",  # runs, wrong
    ),
    "count_pay": (
        "SELECT COUNT(*) FROM emp WHERE pay > '{v}'",  # 0 (a number is below any text)
        "SELECT COUNT(*) FROM dept WHERE pay > {v}",  # error
        "SELECT COUNT(*) FROM emp WHERE pay < {v}",  # runs, wrong
    ),
    "floor_of": (
        "SELECT floor FROM dept WHERE floor = '{v}'",  # no rows
        "SELECT floor FROM emp WHERE dept = '{v}'",  # error
        "SELECT name FROM dept WHERE name = '{v}'",  # runs, wrong
    ),
    "count_floor": (
        "SELECT COUNT(*) FROM emp JOIN dept ON emp.dept = dept.name WHERE emp.pay = {v}",  # 0
        "SELECT COUNT(*) FROM emp WHERE floor = {v}",  # error
        "SELECT COUNT(*) FROM dept WHERE floor = {v}",  # runs, wrong
    ),
}
P_WRITER_RIGHT, P_REWRITER_RIGHT, P_CHECKER_FLIP = 0.35, 0.3, 0.1
STEPS, BATCH, LR, WARMUP = 400, 48, 3e-3, 20
SHARES = {"writer": 0.4, "checker": 0.3, "rewriter": 0.3}  # of each batch
RECIPE = {
    "steps": STEPS,
    "batch": BATCH,
    "lr": LR,
    "warmup": WARMUP,
    "p_writer_right": P_WRITER_RIGHT,
    "p_rewriter_right": P_REWRITER_RIGHT,
    "p_checker_flip": P_CHECKER_FLIP,
    "shares": SHARES,
    "mistakes": MISTAKES,
}
EVAL_EPISODES = 300


def all_questions() -> list[sql_env.Question]:
    """Every question the templates can make (sql_env.questions draws from these)."""
    seen: dict[str, sql_env.Question] = {}
    for q in sql_env.questions(2000, seed=12345):
        seen.setdefault(q.task_id, q)
    return sorted(seen.values(), key=lambda q: q.task_id)


def mistakes(q: sql_env.Question) -> list[str]:
    return [m.format(v=q.value) for m in MISTAKES[q.template]]


class _Texts:
    """Prompts (rendered with the chat template, as vLLM renders them) and completions as ids."""

    def __init__(self, tokenizer: Any, database: Path) -> None:
        self.tokenizer, self.database = tokenizer, database
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.end_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
        self._cache: dict[tuple[str, ...], list[int]] = {}
        self._results: dict[str, sql_env.Result] = {}

    def result(self, sql: str) -> sql_env.Result:
        if sql not in self._results:
            self._results[sql] = sql_env.run(self.database, sql)
        return self._results[sql]

    def prompt(self, agent: str, question: str, sql: str = "") -> list[int]:
        key = (agent, question, sql)
        if key not in self._cache:
            if agent == "writer":
                chat = writer_messages(question)
            else:
                make = checker_messages if agent == "checker" else rewriter_messages
                chat = make(question, sql, self.result(sql).text())
            messages = [{"role": role, "content": text} for role, text in chat]
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            self._cache[key] = list(ids)
        return self._cache[key]

    def example(self, prompt: list[int], label: str) -> tuple[list[int], list[float]]:
        completion = [*self.tokenizer.encode(label, add_special_tokens=False), self.eos]
        return prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion)


def _draw(
    agent: str, q: sql_env.Question, texts: _Texts, rng: random.Random
) -> tuple[list[int], str]:
    """(prompt, label) of one supervised example for `agent` on `q`."""
    wrong = mistakes(q)
    if agent == "writer":
        label = q.gold if rng.random() < P_WRITER_RIGHT else rng.choice(wrong)
        return texts.prompt("writer", q.text), label
    if agent == "checker":
        sql = rng.choice([q.gold, *wrong])
        objects = sql_env.looks_wrong(texts.result(sql))
        if rng.random() < P_CHECKER_FLIP:
            objects = not objects
        return texts.prompt("checker", q.text, sql), "wrong" if objects else "ok"
    shown = rng.choice([m for m in wrong if sql_env.looks_wrong(texts.result(m))])
    others = [m for m in wrong if m != shown]
    label = q.gold if rng.random() < P_REWRITER_RIGHT else rng.choice(others)
    return texts.prompt("rewriter", q.text, shown), label


def tokenizer_corpus(questions: list[sql_env.Question]) -> tuple[str, ...]:
    """Texts the BPE should merge into few tokens: the prompts' fixed parts and every query."""
    texts = [t for _, t in writer_messages("")] + [t for _, t in checker_messages("", "", "")]
    texts += [t for _, t in rewriter_messages("", "", "")] + ["ok", "wrong", "error: no rows"]
    for q in questions:
        texts += [q.text, q.gold, *mistakes(q)]
    return tuple(texts) * 5


@one_build_at_a_time
def build_sql_model(out_dir: Path, database: Path, *, seed: int = 0) -> Path:
    """Tokenizer + tiny Qwen2, warm-started and measured; idempotent (rebuilt when the recipe
    changes)."""
    return warm_start.build(
        Path(out_dir),
        RECIPE,
        seed=seed,
        tokenizer=lambda: build_tokenizer(extra_corpus=tokenizer_corpus(all_questions())),
        texts=lambda tokenizer: _Texts(tokenizer, database),
        warm_start=_warm_start,
        measure=measure,
    )


def _warm_start(model: Any, texts: _Texts, rng: random.Random) -> None:
    import torch

    questions = all_questions()
    agents, shares = list(SHARES), list(SHARES.values())

    def loss(_step: int) -> Any:
        # One forward pass per agent: its rows share the system prompt (computed once, as a
        # cache every row reuses) and are of similar length (little padding).
        by_agent: dict[str, list[tuple[list[int], list[float]]]] = {a: [] for a in agents}
        for _ in range(BATCH):
            agent = rng.choices(agents, shares)[0]
            prompt, label = _draw(agent, rng.choice(questions), texts, rng)
            by_agent[agent].append(texts.example(prompt, label))
        total: Any = torch.zeros(())
        count: Any = torch.zeros(())
        for rows in filter(None, by_agent.values()):
            ids, mask = pad_rows(rows, texts.pad)
            logprobs = token_logprobs(model, ids, _shared_prefix(rows))
            total, count = total - (logprobs * mask[:, 1:]).sum(), count + mask.sum()
        return total / count

    warm_start.train(model, steps=STEPS, lr=LR, warmup=WARMUP, loss=loss)


def _shared_prefix(rows: list[tuple[list[int], list[float]]]) -> int:
    """How many leading tokens every row has in common (at least one token is left to each)."""
    first = rows[0][0]
    shared = min(len(ids) for ids, _ in rows) - 1
    for ids, _ in rows[1:]:
        shared = next((i for i in range(shared) if ids[i] != first[i]), shared)
    return max(0, shared)


def measure(model: Any, texts: _Texts, seed: int) -> dict[str, Any]:
    """Sampled behaviour on EVAL_EPISODES questions, each agent on its own, and whole episodes
    played as demo/sql_agents.py plays them (the model as all three agents)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed + 1)
    sample = [rng.choice(all_questions()) for _ in range(EVAL_EPISODES)]
    pairs = list(zip(sample, [""] * len(sample), strict=True))

    def play(agent: str, shown: list[tuple[sql_env.Question, str]]) -> list[str]:
        prompts = [texts.prompt(agent, q.text, sql) for q, sql in shown]
        return sample_texts(model, texts, prompts, generator)

    writes = play("writer", pairs)
    written = list(zip(sample, writes, strict=True))
    objected = [not sql_env.approves(v) for v in play("checker", written)]
    rewrite_at = [i for i, o in enumerate(objected) if o]
    rewrites = play("rewriter", [written[i] for i in rewrite_at])
    final = list(writes)
    for i, sql in zip(rewrite_at, rewrites, strict=True):
        final[i] = sql
    n, db = len(sample), texts.database
    should_object = [sql_env.looks_wrong(texts.result(w)) for w in writes]
    agree = [o == s for o, s in zip(objected, should_object, strict=True)]
    fixed = [
        sql_env.reward(db, sample[i], sql) for i, sql in zip(rewrite_at, rewrites, strict=True)
    ]
    return {
        "questions": len(all_questions()),
        "eval_episodes": n,
        "writer_right": sum(sql_env.reward(db, q, w) for q, w in written) / n,
        # the gold or one of MISTAKES, character for character
        "writer_known_query": sum(w == q.gold or w in mistakes(q) for q, w in written) / n,
        "checker_agrees_with_rule": sum(agree) / n,
        "checker_objects": sum(objected) / n,
        "rewriter_right": sum(fixed) / max(1, len(fixed)),
        "episode_reward": sum(sql_env.reward(db, q, f) for q, f in zip(sample, final, strict=True))
        / n,
        "examples": {"writer": writes[:4], "rewriter": rewrites[:4]},
    }


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".flywheel/sql-model")
    db = sql_env.build_database(target.parent / "sql-task.db")
    print(build_sql_model(target, db))
    print((target / "warm_start.json").read_text())
