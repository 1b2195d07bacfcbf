"""The SQL task's environment (demo/sql_env.py): a deterministic database, answerable questions,
queries run safely, execution-match reward."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from demo import sql_env
from proxy.config import TAG_PATTERN


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sql_env.build_database(tmp_path_factory.mktemp("sql") / "company.db")


def test_the_database_is_the_same_every_time(db: Path, tmp_path: Path) -> None:
    again = sql_env.build_database(tmp_path / "again.db")
    query = "SELECT * FROM emp ORDER BY name"
    assert sql_env.run(db, query).rows == sql_env.run(again, query).rows
    assert len(sql_env.run(db, query).rows or []) == len(sql_env.NAMES)


def test_every_template_is_drawn_and_every_gold_query_has_an_answer(db: Path) -> None:
    drawn = sql_env.questions(300, seed=1)
    assert set(Counter(q.template for q in drawn)) == {t[0] for t in sql_env.TEMPLATES}
    for q in drawn:
        assert sql_env.reward(db, q, q.gold) == 1.0
        assert not sql_env.looks_wrong(sql_env.run(db, q.gold)), q  # every one has an answer
    assert sql_env.questions(5, seed=1) == drawn[:5]  # reproducible


def test_reward_is_execution_match_in_any_order(db: Path) -> None:
    [q] = [q for q in sql_env.questions(60, seed=2) if q.template == "names_city"][:1]
    city = q.text.removeprefix("Who lives in ").removesuffix("?")
    reordered = f"SELECT name FROM emp WHERE city = '{city}' ORDER BY name DESC"
    assert sql_env.reward(db, q, reordered) == 1.0
    assert sql_env.reward(db, q, "SELECT name FROM emp") == 0.0  # more rows
    assert sql_env.reward(db, q, f"SELECT city FROM emp WHERE city = '{city}'") == 0.0
    assert sql_env.reward(db, q, "SELEC name FROM emp") == 0.0  # a syntax error scores 0


@pytest.mark.parametrize(
    ("sql", "error"),
    [
        ("SELECT nope FROM emp", "no such column: nope"),
        ("DELETE FROM emp", "readonly"),
        ("DROP TABLE emp", "readonly"),
        ("SELECT 1; SELECT 2", "one statement at a time"),
        ("SELECT COUNT(*) FROM emp a, emp b, emp c, emp d", "too long-running"),
        ("SELECT a.name FROM emp a, emp b", "more than 50 rows"),
    ],
)
def test_a_bad_query_comes_back_as_an_error_and_changes_nothing(
    db: Path, sql: str, error: str
) -> None:
    result = sql_env.run(db, sql)
    assert result.rows is None and error in (result.error or ""), result
    assert result.text().startswith("error: ")
    assert sql_env.run(db, "SELECT COUNT(*) FROM emp").rows == [(len(sql_env.NAMES),)]


def test_task_ids_are_valid_tags_and_group_repeats_of_a_question() -> None:
    drawn = sql_env.questions(200, seed=3)
    assert all(re.fullmatch(TAG_PATTERN, q.task_id) for q in drawn)
    by_task = {q.task_id: q.text for q in drawn}
    assert all(by_task[q.task_id] == q.text for q in drawn)  # one question per task id
