"""The dashboard in a real browser: headless Chromium (Debian's `chromium`, installed by `make
test`'s set-up) driven by Playwright, against a running proxy on real Postgres and the fake vLLM.

The data is made through the real API: calls on three trained versions, rewards posted, and a
canary opened by a publish and decided by core.canary's own test (its candidate answers badly,
so it is rolled back). The browser loads every page, searches and pages the episode list, opens
an episode and its tokens, and rolls the policy back by clicking. With FLYWHEEL_SCREENSHOTS=dir
the pages' screenshots are saved there (docs/img/dashboard-*.png come from this test).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from playwright.sync_api import sync_playwright
from psycopg.types.json import Jsonb

from core import canary, policy
from core.database import Sessions
from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy
from tests.core.test_lineages import publish

ADMIN = "admin-secret"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]


def ask(proxy: RunningProxy, episode: str, content: str, *, tools: bool = False) -> str:
    headers = {
        "X-Episode-Id": episode,
        "X-Task-Id": f"sum-{len(episode) % 3}",
        "X-Agent-Name": "solver",
    }
    body: dict[str, Any] = {
        "model": "policy",
        "max_tokens": 12,
        "messages": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": content},
        ],
    }
    if tools:
        body["tools"] = TOOLS
    with proxy.client(**headers) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    return r.headers["x-policy-version"]


def reward(proxy: RunningProxy, episode: str, value: float) -> None:
    with proxy.client() as c:
        assert (
            c.post("/v1/rewards", json={"episode_id": episode, "reward": value}).status_code == 200
        )


@dataclass
class Stack:
    proxy: RunningProxy
    versions: list[int]  # v1, v2 (trained, current), v3 (the rolled-back canary)
    rejected: int  # v4, failed by the promotion gate on its eval set


@pytest.fixture
def stack(make_proxy: Any, sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path) -> Stack:
    """A proxy with five hours of history: base model, v1, v2 (rewards rising), then v3 as a
    canary that earns less and is rolled back."""
    proxy = make_proxy(admin_key=ADMIN)
    rng = random.Random(7)
    n = 0

    def episodes(count: int, low: float, high: float, *, bad_version: str | None = None) -> None:
        nonlocal n
        for _ in range(count):
            n += 1
            eid = f"ep-{n:03d}"
            version = ask(proxy, eid, f"What is {n} + {n % 7}?", tools=n % 4 == 0)
            bad = version == bad_version
            reward(proxy, eid, round(rng.uniform(0.0, 0.15) if bad else rng.uniform(low, high), 3))

    episodes(16, 0.1, 0.5)
    versions = []
    for low, high in [(0.3, 0.7), (0.5, 0.9)]:
        versions.append(publish(sessions, fake_vllm, tmp_path, "policy"))
        proxy.wait_policy(versions[-1])
        episodes(16, low, high)
    rule = canary.Rule(fraction=0.5, min_episodes=4)
    candidate = publish(sessions, fake_vllm, tmp_path, "policy", canary_rule=rule)
    versions.append(candidate)
    proxy.wait_policy(candidate, canary=True)
    episodes(24, 0.5, 0.9, bad_version=str(candidate))
    # A message a browser must show as text, never run.
    ask(proxy, "ep-html", '<img src=x onerror="window.pwned=1"> What is <b>1 + 1</b>?')
    proxy.wait_rows("SELECT 1 FROM transition", n + 1)
    with sessions.begin() as session:
        opened = canary.opened(session=session)["policy"]
        evidence = canary.weigh(*canary.evidence_rows(opened, session=session), rule)
        decision = canary.decide(evidence, rule, age_s=0)
        assert decision is not None and decision.action == "rollback", evidence
        assert policy.decide_canary(opened, decision, session=session)
    # What the promotion gate made of v2 (passed) and of a v4 it failed (issue 42).
    with sessions.begin() as session:
        rejected = policy.next_version(session=session)
    judged = {
        "evals": {"arithmetic": {"score": 0.82, "current": 0.79, "items": 50, "digest": "d"}},
        "ope": {"candidate": {"value": 0.71}, "current": {"value": 0.66}, "episodes": 64},
        "gate": {"outcome": "pass", "reason": "not worse by the margin 0.02"},
    }
    failed = {
        "evals": {"arithmetic": {"score": 0.4, "current": 0.82, "items": 50, "digest": "d"}},
        "gate": {
            "outcome": "fail",
            "reason": f"eval arithmetic 0.400 against v{versions[1]}'s 0.820",
        },
    }
    with psycopg.connect(proxy.database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE adapter_version SET stats = coalesce(stats, '{}') || %s WHERE version = %s",
            (Jsonb(judged), versions[1]),
        )
        conn.execute(
            "INSERT INTO adapter_version (version, name, path, base_model, stats, retired_at) "
            "VALUES (%s, %s, '/gone', 'demo', %s, now())",
            (rejected, f"policy-v{rejected}", Jsonb(failed)),
        )
    # Spread the history over the last five hours, in the order it was made.
    with psycopg.connect(proxy.database_url, autocommit=True) as conn:
        conn.execute("""
            WITH ranked AS (
                SELECT id, count(*) OVER () - row_number() OVER (ORDER BY created_at) AS back
                FROM episode)
            UPDATE episode e SET created_at = now() - make_interval(secs => 3 * 60 + back * 220)
            FROM ranked r WHERE r.id = e.id""")
        conn.execute("""
            UPDATE transition t SET requested_at = e.created_at + interval '1 second'
            FROM episode e WHERE e.id = t.episode_id""")
        # What a trainer would have made of them: most trained, some set aside with a reason.
        conn.execute("""
            WITH numbered AS (SELECT id, row_number() OVER (ORDER BY requested_at) AS i
                              FROM transition WHERE credited_at IS NOT NULL)
            UPDATE transition t SET
                trained_at = CASE WHEN n.i % 9 NOT IN (0, 4) THEN now() END,
                skip_reason = CASE n.i % 9 WHEN 0 THEN 'greedy'
                                           WHEN 4 THEN 'constrained_decoding' END
            FROM numbered n WHERE n.id = t.id AND n.i <= 60""")
    return Stack(proxy, versions, rejected)


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1360, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        # What the dashboard's Content-Security-Policy refused (an inline style, say): console only.
        page.on("console", lambda m: "Content Security Policy" in m.text and errors.append(m.text))
        # "Serve v1 as the current policy?" - yes; "Pin ...: why?" - a note.
        page.on("dialog", lambda d: d.accept("known good" if d.type == "prompt" else None))
        yield page
        browser.close()
        assert errors == [], errors  # no script error and nothing refused, on any page


def shot(page: Any, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("FLYWHEEL_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"dashboard-{name}.png"), full_page=True)


def go(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("main[data-ready]")


@pytest.mark.slow
def test_the_dashboard_in_a_browser(stack: Stack, page: Any, tmp_path: Path) -> None:
    url = stack.proxy.url
    v1, v2, v3 = stack.versions
    # Overview: the current version, the canary's decision, charts drawn, per-version rewards.
    go(page, f"{url}/ui/")
    main = page.locator("main")
    assert "current · policy" in main.inner_text()
    assert page.locator(".chart canvas").count() == 3  # reward/time, calls/s, reward/version
    versions = page.locator("#versions").inner_text()
    assert "base model" in versions and f"v{v3}" in versions
    decisions = page.locator("table.canaries").inner_text()
    assert f"v{v3}" in decisions and "rollback" in decisions and "worse" in decisions
    shot(page, "overview", tmp_path)
    # The training-data panel: the share trained, and why the rest was not, with the fix.
    training = page.locator("#training").inner_text()
    assert "decided calls became training data" in training
    assert "greedy calls carry no exploration" in training
    assert "declare tools non-strict" in training
    folder = Path(os.environ.get("FLYWHEEL_SCREENSHOTS") or tmp_path)
    page.locator("#training").screenshot(path=str(folder / "dashboard-training.png"))

    # Filtering the overview by task reloads it with that task's figures.
    page.select_option("select >> nth=2", index=1)
    page.wait_for_selector("main[data-ready*='task=']")
    assert "task=sum-" in page.url

    # Episodes: newest first, 50 a page, keyset paging, a search.
    go(page, f"{url}/ui/#/episodes")
    rows = page.locator("#episodes tbody tr")
    assert rows.count() == 50 and "ep-html" in rows.first.inner_text()
    page.click("text=Older →")
    page.wait_for_selector("main[data-ready*='trail=']")
    assert page.locator("#episodes tbody tr").count() == 73 - 50
    assert "ep-001" in page.locator("#episodes tbody tr").last.inner_text()
    page.fill("input[name=q]", "ep-01")
    page.fill("input[name=min_reward]", "0.3")
    page.click("button:has-text('Search')")
    page.wait_for_selector("main[data-ready*='q=ep-01']")
    found = [r.split("\t")[0] for r in rows.all_inner_texts()]
    assert found and all(f.startswith("ep-01") for f in found), found

    # An episode: its messages, completion, reward; tokens coloured by logprob on request.
    page.click(f"a:has-text('{found[0]}')")
    page.wait_for_selector("main[data-ready^='#/episode/']")
    text = main.inner_text()
    assert f"Episode {found[0]}" in text and "Answer with a number." not in text  # folded
    page.click("summary")
    assert "Answer with a number." in main.inner_text()
    page.click("text=Show tokens by logprob")
    page.wait_for_selector(".tokens span")
    colours = page.eval_on_selector_all(".tokens span", "s => s.map(e => e.style.background)")
    assert colours and all(c.startswith("rgb") for c in colours), colours
    shot(page, "episode", tmp_path)

    # Agent text is shown as text.
    go(page, f"{url}/ui/#/episode/ep-html")
    page.click("summary")
    assert '<img src=x onerror="window.pwned=1">' in main.inner_text()
    assert page.evaluate("window.pwned") is None and page.locator("main img").count() == 0

    # Adapters: without the admin key the page says what it needs; with it, roll back to v1.
    go(page, f"{url}/ui/#/adapters")
    assert "admin key" in main.inner_text()
    page.fill("#key", ADMIN)
    page.click("text=Use key")
    page.wait_for_selector("tr.current")
    assert "tenant * · admin" in page.inner_text("#who")
    assert page.locator("tr.current td").first.inner_text().startswith(f"v{v2} ")
    assert page.locator(f"tr.retired:has-text('v{v3} ')").count() == 1  # rolled back
    # Before serving: v2 passed the gate (its eval score and estimate beside the current's); v4
    # failed it, retired unserved, the reason on the page.
    judged = page.locator("tr.current td").nth(8).inner_text()
    assert "gate pass" in judged and "arithmetic 0.820 vs 0.790" in judged, judged
    assert "est. 0.710 vs 0.660" in judged, judged
    v4 = page.locator(f"tr.retired:has-text('v{stack.rejected} ')").inner_text()
    assert "gate fail" in v4 and f"eval arithmetic 0.400 against v{v2}'s 0.820" in v4, v4
    shot(page, "adapters", tmp_path)
    page.locator("tr", has_text=f"v{v1} ").locator("button:has-text('Activate')").click()
    page.wait_for_selector(f"tr.current:has-text('v{v1} ')")
    with stack.proxy.client() as c:  # the same code path as POST /admin/...: the alias moved
        chat = {"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "q"}]}
        r = c.post("/v1/chat/completions", json=chat)
    assert r.headers["x-policy-version"] == str(v1)

    # Pin v2 (with the note the prompt asks for): served, held, then unpinned.
    page.locator("tr", has_text=f"v{v2} ").locator("button.pin").click()
    page.wait_for_selector(f"h2:has-text('pinned at v{v2}')")
    assert "known good" in page.inner_text("h2:has-text('pinned')")
    assert page.locator("button:has-text('Activate')").count() == 0  # held: activate would 409
    with stack.proxy.client() as c:
        assert c.post("/v1/chat/completions", json=chat).headers["x-policy-version"] == str(v2)
    page.click("button.unpin")
    page.wait_for_selector("main[data-ready] button:has-text('Activate')")
    assert page.locator("h2:has-text('pinned')").count() == 0

    # Another key (auth is off here: it only loses the admin rights) says so.
    page.fill("#key", "not-the-admin-key")
    page.click("text=Use key")
    page.wait_for_selector("main[data-ready] .notice")
    assert "not the admin key" in main.inner_text() and "admin" not in page.inner_text("#who")
