"""The environment of the SQL-shaped multi-agent task (issue 12; the paper's Spider agent in
miniature): a small SQLite database the project generates, questions from a handful of templates
with their gold queries, running a query safely, and the reward.

    database   two tables, the same rows every time (seeded):
                 dept(name TEXT, floor INTEGER)                       4 rows
                 emp(name TEXT, dept TEXT, city TEXT, pay INTEGER)    24 rows
    questions  six templates ("How many employees live in rome?" -> SELECT COUNT(*) FROM emp
               WHERE city = 'rome'), one of them a join; `questions(seed)` draws them
    run        a query on a read-only connection: one statement, at most MAX_ROWS rows, aborted
               after MAX_STEPS virtual-machine steps (no cross join runs away); errors come back
               as text, as a checker agent would show them to a rewriter
    reward     execution match: 1.0 when the final query's rows equal the gold query's (as a
               multiset: the questions do not ask for an order), else 0.0

The agents that play it (a writer proposes SQL, a checker runs it and judges, a rewriter fixes it)
talk through the proxy with their own X-Agent-Name, so that each can have its own lineage.
"""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

DEPTS = (("sales", 1), ("ops", 2), ("lab", 3), ("hr", 4))
CITIES = ("oslo", "rome", "lima", "kyiv")
# A table, twelve short names a row (fmt: skip keeps its rows).
NAMES = (
    "ada", "bo", "cy", "di", "ed", "fay", "gus", "hal", "ivy", "jo", "kai", "lu",
    "max", "ned", "oz", "pia", "quin", "ray", "sol", "tam", "uma", "vic", "wes", "zoe",
)  # fmt: skip
SCHEMA = (
    "CREATE TABLE dept (name TEXT PRIMARY KEY, floor INTEGER NOT NULL);\n"
    "CREATE TABLE emp (name TEXT PRIMARY KEY, dept TEXT NOT NULL REFERENCES dept(name), "
    "city TEXT NOT NULL, pay INTEGER NOT NULL);"
)
MAX_ROWS = 50
MAX_STEPS = 200_000  # SQLite VM instructions: ample for these tables, fatal to a runaway query

# (name, question, gold SQL): {city}, {dept}, {pay} and {floor} are filled in by `questions`.
# A table (fmt: skip keeps each question above its gold SQL).
TEMPLATES = (
    ("count_city", "How many employees live in {city}?",
     "SELECT COUNT(*) FROM emp WHERE city = '{city}'"),
    ("names_city", "Who lives in {city}?",
     "SELECT name FROM emp WHERE city = '{city}'"),
    ("top_pay", "What is the top pay in {dept}?",
     "SELECT MAX(pay) FROM emp WHERE dept = '{dept}'"),
    ("count_pay", "How many employees earn over {pay}?",
     "SELECT COUNT(*) FROM emp WHERE pay > {pay}"),
    ("floor_of", "Which floor is {dept} on?",
     "SELECT floor FROM dept WHERE name = '{dept}'"),
    ("count_floor", "How many employees work on floor {floor}?",
     "SELECT COUNT(*) FROM emp JOIN dept ON emp.dept = dept.name WHERE dept.floor = {floor}"),
)  # fmt: skip


# The agents' prompts (demo/sql_agents.py sends them; demo/sql_model.py warm-starts on them).
SCHEMA_HINT = "Tables: dept(name, floor), emp(name, dept, city, pay)."
WRITER_SYSTEM = f"Write one SQLite query that answers the question. {SCHEMA_HINT}"
CHECKER_SYSTEM = "Does the query answer the question? Say ok or wrong."
REWRITER_SYSTEM = f"The query is wrong. Write a correct SQLite query. {SCHEMA_HINT}"


def writer_messages(question: str) -> list[tuple[str, str]]:
    return [("system", WRITER_SYSTEM), ("user", question)]


def checker_messages(question: str, sql: str, result: str) -> list[tuple[str, str]]:
    return [
        ("system", CHECKER_SYSTEM),
        ("user", f"Question: {question}\nQuery: {sql}\nResult: {result}"),
    ]


def rewriter_messages(question: str, sql: str, result: str) -> list[tuple[str, str]]:
    return [
        ("system", REWRITER_SYSTEM),
        ("user", f"Question: {question}\nQuery: {sql}\nResult: {result}"),
    ]


def approves(verdict: str) -> bool:
    return verdict.strip().lower().startswith("ok")


@dataclass(frozen=True)
class Question:
    template: str  # a TEMPLATES name
    value: str  # what fills its blank ("rome", "50", ...)
    text: str
    gold: str

    @property
    def task_id(self) -> str:
        """`count_city:rome`: repeats of one question form one GRPO group (a valid tag)."""
        return f"{self.template}:{self.value}"


def default_database() -> Path:
    """The database in the temp directory, named by what generates it (a change makes a new one):
    every process of a run (the model's warm start, the agents) builds or finds the same rows."""
    recipe = repr((DEPTS, CITIES, NAMES, SCHEMA)).encode()
    digest = hashlib.blake2b(recipe, digest_size=6).hexdigest()
    return build_database(Path(tempfile.gettempdir()) / f"flywheel-sql-{digest}.db")


def build_database(path: Path, *, seed: int = 0) -> Path:
    """Write the database to `path` (the same rows for the same seed); idempotent."""
    if path.exists():
        return path
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")  # two builders at once: each its own
    partial.unlink(missing_ok=True)
    with sqlite3.connect(partial) as db:
        db.executescript(SCHEMA)
        db.executemany("INSERT INTO dept VALUES (?, ?)", DEPTS)
        db.executemany(
            "INSERT INTO emp VALUES (?, ?, ?, ?)",
            [
                (name, rng.choice(DEPTS)[0], rng.choice(CITIES), 10 * rng.randint(3, 9))
                for name in NAMES
            ],
        )
    db.close()
    partial.rename(path)
    return path


def questions(count: int, *, seed: int) -> list[Question]:
    """`count` questions, each template equally likely, its blanks drawn from the database's
    own values (so every gold query has an answer)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        name, text, gold = rng.choice(TEMPLATES)
        values = {
            "city": rng.choice(CITIES),
            "dept": rng.choice(DEPTS)[0],
            "pay": 10 * rng.randint(3, 8),
            "floor": rng.choice(DEPTS)[1],
        }
        [blank] = [k for k in values if "{" + k + "}" in text]
        value = str(values[blank])
        out.append(Question(name, value, text.format(**values), gold.format(**values)))
    return out


@dataclass(frozen=True)
class Result:
    rows: list[tuple[object, ...]] | None  # None: the query failed
    error: str | None = None

    def text(self) -> str:
        """As a checker shows it: the rows, or the error."""
        if self.rows is None:
            return f"error: {self.error}"
        if not self.rows:
            return "no rows"
        return "; ".join(", ".join(str(v) for v in row) for row in self.rows)


def run(database: Path, sql: str) -> Result:
    """Run one query read-only, bounded in steps and rows. Never raises for a bad query."""
    db = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    steps = [0]

    def too_long() -> int:
        steps[0] += 1000
        return 1 if steps[0] > MAX_STEPS else 0

    db.set_progress_handler(too_long, 1000)
    try:
        cursor = db.execute(sql)
        rows = cursor.fetchmany(MAX_ROWS + 1)
    except (sqlite3.Error, sqlite3.Warning, ValueError) as e:  # Warning: several statements
        message = "query too long-running" if steps[0] > MAX_STEPS else str(e)
        return Result(None, message)
    finally:
        db.close()
    if len(rows) > MAX_ROWS:
        return Result(None, f"more than {MAX_ROWS} rows")
    return Result([tuple(row) for row in rows])


def looks_wrong(result: Result) -> bool:
    """What a careful checker objects to: an error, no rows, or a lone 0 or NULL (these
    questions all have an answer, and none of them is zero)."""
    return result.rows is None or not result.rows or result.rows in ([(0,)], [(None,)])


def reward(database: Path, question: Question, sql: str) -> float:
    """Execution match: the same rows as the gold query, in any order."""
    got = run(database, sql)
    if got.rows is None:
        return 0.0
    gold = run(database, question.gold)
    assert gold.rows is not None, f"gold query failed: {gold.error}"
    return 1.0 if Counter(got.rows) == Counter(gold.rows) else 0.0
