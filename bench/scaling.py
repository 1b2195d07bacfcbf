"""Scaling: how the proxy's overhead and recording rate change with clients and prompt length.

The same set-up as bench/proxy_overhead.py (fake vLLM, `flywheel proxy` recording into a real
Postgres, load generator here), non-streaming, direct and Flywheel interleaved, over two axes:
concurrent clients (1 to 256) and prompt length: `short` (one ~20-token user message) and `long`
(a 20-message multi-turn history of ~4,000 tokens; the fake returns prompt_token_ids of the same
length, which the proxy parses, strips for the client and records). Every call's last message is
new; a client's history repeats across its calls, as an agent's does. After each Flywheel run the
transitions are counted in Postgres: the recording rate includes the writer's drain after the
load stopped, and `lost` is what never arrived.

    PYTHONPATH=. .venv/bin/python -m bench.scaling [--concurrency 1,16,64,256]
        [--prompts short,long] [--seconds 3] [--profile] [--note "shared machine"]

`--profile` then attaches py-spy to the proxy at 1 and 64 clients (short prompts) and at 64
(long), and prints the top functions by own time with their total (inclusive) share. Appends a
dated section to bench/scaling.md and writes docs/img/scaling.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from bench import common, plots, pyspy
from fakes import processes
from fakes.vllm import chat_prompt_ids

RESULTS = Path(__file__).with_suffix(".md")
IMG_DIR = processes.ROOT / "docs" / "img"
PROFILE_DIR = processes.WORK / "profiles"  # the raw collapsed stacks (git-ignored)
PROFILES = [("short", 1), ("short", 64), ("long", 64)]
TOP = 15  # rows per profile table
WORDS = [
    "the",
    "agent",
    "reads",
    "the",
    "file",
    "then",
    "calls",
    "a",
    "tool",
    "to",
    "check",
    "the",
    "result",
    "of",
    "its",
    "last",
    "step",
]


def _text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(words))


def messages(prompt: str, client: int, i: int) -> list[dict[str, str]]:
    if prompt == "short":
        return [{"role": "user", "content": f"What is {client} + {i}? Answer with a number."}]
    history = [{"role": "system", "content": _text(0, 190)}]  # shared by every client
    for turn in range(18):
        role = "user" if turn % 2 == 0 else "assistant"
        history.append(
            {"role": role, "content": f"client {client} turn {turn}: {_text(turn, 190)}"}
        )
    return [*history, {"role": "user", "content": f"call {i}: " + _text(i, 190)}]


def body_factory(prompt: str) -> common.BodyFactory:
    return lambda client, i: common.chat_body(messages(prompt, client, i), stream=False)


@dataclass
class Row:
    prompt: str
    clients: int
    prompt_tokens: int
    request_kb: float
    upstream_kb: float  # vLLM's answer to the proxy (token ids and logprobs asked for)
    direct: common.Run
    flywheel: common.Run
    proxy_cpu_s: float
    postgres_cpu_s: float | None
    proxy_peak_rss_mb: float
    recorded: int
    drain_s: float
    lost: int

    def added(self, q: float) -> float:
        return (
            common.quantile(self.flywheel.latencies, q) - common.quantile(self.direct.latencies, q)
        ) * 1e3

    def rps(self, run: common.Run) -> float:
        return len(run.latencies) / run.elapsed if run.elapsed else 0.0

    def per_request_ms(self, cpu_s: float | None) -> float | None:
        return None if cpu_s is None else cpu_s / max(1, len(self.flywheel.latencies)) * 1e3

    @property
    def recording_rate(self) -> float:
        return self.recorded / (self.flywheel.elapsed + self.drain_s)


def sizes(fake_url: str, prompt: str) -> tuple[int, float, float]:
    """Prompt tokens, request KB, and the KB of the answer the proxy gets (ids + logprobs)."""
    body = orjson.loads(body_factory(prompt)(0, 0))
    upstream = {**body, "return_token_ids": True, "logprobs": True}
    answer = httpx.post(fake_url + "/v1/chat/completions", json=upstream, timeout=30).content
    tokens = len(chat_prompt_ids(body))
    return tokens, len(orjson.dumps(body)) / 1024, len(answer) / 1024


def measure(
    fake: processes.Server,
    flywheel: processes.Server,
    db_url: str,
    postgres: common.ProcessMeter | None,
    prompt: str,
    clients: int,
    seconds: float,
    rounds: int,
    proxy: common.ProcessMeter,
) -> Row:
    make_body = body_factory(prompt)
    direct, through = common.Run(), common.Run()
    proxy_cpu = postgres_cpu = drain = 0.0
    recorded = expected = common.count_transitions(db_url)
    for r in range(rounds):
        for target in ("direct", "flywheel") if r % 2 == 0 else ("flywheel", "direct"):
            if target == "direct":
                run = common.load(fake.url + "/v1/chat/completions", make_body, clients, seconds)
                _merge(direct, run)
                continue
            cpu = proxy.cpu_s(), postgres.cpu_s() if postgres else 0.0
            run = common.load(flywheel.url + "/v1/chat/completions", make_body, clients, seconds)
            expected += len(run.latencies) + run.failed  # a failed call is recorded too
            stored, waited = common.wait_recorded(db_url, expected)
            proxy_cpu += proxy.cpu_s() - cpu[0]
            postgres_cpu += (postgres.cpu_s() if postgres else 0.0) - cpu[1]
            drain += waited
            _merge(through, run)
    stored = common.count_transitions(db_url)
    tokens, request_kb, upstream_kb = sizes(fake.url, prompt)
    return Row(
        prompt,
        clients,
        tokens,
        request_kb,
        upstream_kb,
        direct,
        through,
        proxy_cpu,
        postgres_cpu if postgres else None,
        proxy.peak_rss / 2**20,
        stored - recorded,
        drain,
        max(0, expected - stored),
    )


def _merge(into: common.Run, run: common.Run) -> None:
    into.latencies += run.latencies
    into.failed += run.failed
    into.elapsed += run.elapsed


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or value != value else f"{value:,.{digits}f}"


def table(rows: list[Row]) -> str:
    out = [
        "| prompt | prompt tokens | request KB | upstream answer KB | clients | direct p50 ms "
        "| added p50 ms | added p99 ms | direct req/s | flywheel req/s | flywheel / direct "
        "| proxy CPU ms/req | Postgres CPU ms/req | recorded/s | drain s | lost "
        "| proxy peak RSS MB | failed |",
        "|---" * 18 + "|",
    ]
    for r in rows:
        direct_rps, fw_rps = r.rps(r.direct), r.rps(r.flywheel)
        out.append(
            f"| {r.prompt} | {r.prompt_tokens} | {r.request_kb:.1f} | {r.upstream_kb:.1f} | "
            f"{r.clients} | {_f(common.quantile(r.direct.latencies, 0.5) * 1e3)} | "
            f"{_f(r.added(0.5))} | {_f(r.added(0.99))} | {direct_rps:,.0f} | {fw_rps:,.0f} | "
            f"{_f(fw_rps / direct_rps if direct_rps else None)} | "
            f"{_f(r.per_request_ms(r.proxy_cpu_s))} | {_f(r.per_request_ms(r.postgres_cpu_s))} | "
            f"{r.recording_rate:,.0f} | {r.drain_s:.2f} | {r.lost} | {r.proxy_peak_rss_mb:.0f} | "
            f"{r.direct.failed + r.flywheel.failed} |"
        )
    return "\n".join(out)


def plot(rows: list[Row], img_dir: Path) -> Path:
    clients = sorted({r.clients for r in rows})
    prompts = list(dict.fromkeys(r.prompt for r in rows))
    at = {(r.prompt, r.clients): r for r in rows}

    def series(value: object) -> dict[str, list[float]]:
        return {p: [value(at[(p, n)]) for n in clients] for p in prompts}  # type: ignore[operator]

    panels = {
        "added latency p50 (ms)": series(lambda r: r.added(0.5)),
        "proxy CPU per request (ms)": series(lambda r: r.per_request_ms(r.proxy_cpu_s)),
        "flywheel / direct throughput": series(lambda r: r.rps(r.flywheel) / r.rps(r.direct)),
    }
    return plots.lines(
        img_dir / "scaling.png",
        clients,
        panels,
        xlabel="concurrent clients",
        ylabel="",
        title="Flywheel proxy vs direct, by clients and prompt length (~20 vs ~4,000 tokens)",
    )


def profile(flywheel: processes.Server, seconds: float) -> list[str]:
    """py-spy on the proxy under load; the top functions by own and by total time, as lines."""
    out = []
    for prompt, clients in PROFILES:
        raw = PROFILE_DIR / f"proxy_{prompt}_{clients}.txt"
        spy = pyspy.start_profile(flywheel.process.pid, seconds, raw)
        time.sleep(0.5)  # py-spy attaches
        url = flywheel.url + "/v1/chat/completions"
        run = common.load(url, body_factory(prompt), clients, seconds)
        _, err = spy.communicate(timeout=60)
        if spy.returncode != 0 or not raw.exists():
            raise SystemExit(f"py-spy failed ({spy.returncode}): {err.decode()[-2000:]}")
        p = pyspy.summarise_profile(raw)
        ours = sorted(
            (
                (f, share)
                for f, share in p.total.items()
                if "(proxy/" in f or "(core/" in f  # our code on the proxy's path
            ),
            key=lambda item: item[1],
            reverse=True,
        )
        out += [
            f"\n#### py-spy: {prompt} prompts, {clients} clients "
            f"({len(run.latencies) / run.elapsed:,.0f} req/s, {p.samples} busy samples; "
            f"raw stacks: {raw.relative_to(processes.ROOT)})\n",
            "Own time by area: "
            + ", ".join(f"{area} {share:.0%}" for area, share in p.areas[:8] if share >= 0.01)
            + "\n",
            "| top own time | share | | proxy/ function | total (inclusive) |",
            "|---|---|---|---|---|",
        ]
        for k in range(TOP):
            own = p.own[k] if k < len(p.own) else ("", 0.0)
            mine = ours[k] if k < len(ours) else ("", 0.0)
            out.append(
                f"| `{own[0]}` | {own[1]:.1%} | | `{mine[0]}` | {mine[1]:.1%} |"
                if own[0] and mine[0]
                else f"| `{own[0]}` | {own[1]:.1%} | | | |"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated clients")
    parser.add_argument("--prompts", default="short,long", help="short (~20 tokens), long (~4k)")
    parser.add_argument("--seconds", type=float, default=3.0, help="per target, per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per cell")
    common.add_fake_arguments(parser)
    parser.add_argument("--profile", action="store_true", help="py-spy the proxy afterwards")
    parser.add_argument("--profile-seconds", type=float, default=8.0)
    parser.add_argument("--database-url", help="default: an embedded Postgres (.flywheel/bench)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="report to append to")
    parser.add_argument("--img-dir", type=Path, default=IMG_DIR, help="where the PNG goes")
    parser.add_argument("--note", default="", help="a line for the report (e.g. machine state)")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prompts = args.prompts.split(",")

    servers: list[processes.Server] = []
    meters: list[common.ProcessMeter] = []
    rows: list[Row] = []
    profile_lines: list[str] = []
    with common.bench_database(args.database_url) as db_url:
        try:
            fake = processes.start_fake(args.latency_s, always_detail=not args.lean_fake)
            servers.append(fake)
            flywheel = processes.start_flywheel(fake.url, db_url)
            servers.append(flywheel)
            proxy = common.ProcessMeter(flywheel.process.pid)
            meters.append(proxy)
            pg_pid = None if args.database_url else common.postgres_pid(db_url)
            postgres = common.ProcessMeter(pg_pid) if pg_pid else None
            if postgres:
                meters.append(postgres)
            for prompt in prompts:  # warm-up, not counted
                common.load(flywheel.url + "/v1/chat/completions", body_factory(prompt), 4, 0.5)
            for prompt in prompts:
                for clients in concurrencies:
                    row = measure(
                        fake,
                        flywheel,
                        db_url,
                        postgres,
                        prompt,
                        clients,
                        args.seconds,
                        args.rounds,
                        proxy,
                    )
                    rows.append(row)
                    print(
                        f"{prompt:>5} {clients:>4} clients: added p50 {row.added(0.5):7.2f} ms, "
                        f"{row.rps(row.flywheel):6.0f} req/s, {row.recording_rate:6.0f} rec/s",
                        file=sys.stderr,
                    )
            if args.profile:
                profile_lines = profile(flywheel, args.profile_seconds)
        finally:
            for meter in meters:
                meter.close()
            for server in reversed(servers):
                server.stop()

    body = table(rows)
    print(body, *profile_lines, sep="\n")
    png = plot(rows, args.img_dir)
    common.append_report(args.results, "Scaling", "bench.scaling", args, [body, *profile_lines])
    print("wrote", args.results, png, file=sys.stderr)


if __name__ == "__main__":
    main()
