"""The chaos suite's faults of issue 31 (bench/chaos.py registers and runs them; its table):

  pg-disk-full         Postgres's own data directory on a 1 GiB tmpfs, filled by a filler
                       file under traffic for --outage-s, then the filler deleted (Postgres
                       started again if it stopped); the note says what Postgres did
  pg-partition         proxy and Postgres over TCP (127.0.0.1), every packet between them
                       dropped for --outage-s (iptables, fakes/netfault.py), then healed
  vllm-partition       the same between the proxy and one vLLM replica, its streams under way
                       (the fakes stream 8 tokens at 0.1 s each here)
  pg-stop+proxy-term   Postgres stopped; the proxy SIGTERMed during it and started again while
                       Postgres is still down; then Postgres started
  journal-full+proxy-kill   the journal on a 64 KiB tmpfs, Postgres stopped, then the proxy
                       kill -9ed: what its writer held in memory is lost (the note counts it)
  proxy-oom            the proxy in a cgroup v1 memory cgroup of --oom-limit-mb, traffic of
                       20-50 KB prompts without X-Episode-Id for --oom-s; RSS over time and
                       whether the OOM killer fired

All need root (iptables, tmpfs mounts, cgroups).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil

from bench import common
from fakes import netfault

if TYPE_CHECKING:
    from bench.chaos import Stack, Traffic

FAULTS = (
    "pg-disk-full",
    "pg-partition",
    "vllm-partition",
    "pg-stop+proxy-term",
    "journal-full+proxy-kill",
    "proxy-oom",
)
# The filler takes every free block whatever the size, so the size only says how much room there
# is once it is deleted: 160 MiB held initdb and a few minutes of traffic, not what a minute's
# outage journals (45,000 transitions replayed filled it again, and Postgres stopped for good).
PG_DISK_MB = 1024
STREAM_TOKEN_DELAY_S = 0.1  # vllm-partition: streams long enough to be cut in the middle
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def inject(fault: str, s: Stack, args: argparse.Namespace, traffic: Traffic) -> str:
    """Do the fault and heal it; returns the table's note."""
    outage_s = float(args.outage_s)
    if fault == "pg-disk-full":
        return pg_disk_full(s, outage_s)
    if fault == "pg-partition":
        return pg_partition(s, outage_s)
    if fault == "vllm-partition":
        return vllm_partition(s, outage_s, traffic)
    if fault == "pg-stop+proxy-term":
        return pg_stop_proxy_term(s, outage_s)
    if fault == "journal-full+proxy-kill":
        return journal_full_proxy_kill(s, outage_s)
    if fault == "proxy-oom":
        return proxy_oom(s, args.oom_s, args.oom_limit_mb)  # (run_fault made the group)
    raise ValueError(f"unknown fault {fault!r}")


# --- Postgres's disk full ----------------------------------------------------------------------


def pg_disk_full(s: Stack, outage_s: float) -> str:
    assert s.pg.disk is not None
    filler = s.pg.disk / "filler"
    # every free block, as root (no reserve on a tmpfs)
    with filler.open("wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 2**20)
            f.flush()
    filled_mb = filler.stat().st_size / 2**20
    deadline = time.monotonic() + outage_s
    down_after = None
    while time.monotonic() < deadline:
        if down_after is None and not _postmaster_alive(s.pg.pgdata):
            down_after = outage_s - (deadline - time.monotonic())
        time.sleep(0.2)
    journaled = common.metric(s.url, "flywheel_transitions_journaled_total")
    filler.unlink()
    restarted = not _postmaster_alive(s.pg.pgdata)
    if restarted:
        s.pg.start()
    log = (s.pg.pgdata / "log").read_text(errors="replace")
    said = sorted({m.group(0) for m in re.finditer(r"(PANIC|FATAL|ERROR): +[^\n:]{0,60}", log)})
    what = (
        f"the postmaster stopped {down_after:.0f} s in, started again after"
        if restarted and down_after is not None
        else "Postgres stayed up"
    )
    return (
        f"filler {filled_mb:.0f} MiB; {what}; the proxy journaled {journaled:.0f}; "
        f"Postgres said: {'; '.join(said[:4]) or 'nothing in its log (the log is on that disk)'}"
    )


def _postmaster_alive(pgdata: Path) -> bool:
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    return psutil.pid_exists(pid) and bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)


# --- partitions ----------------------------------------------------------------------------------


def pg_partition(s: Stack, outage_s: float) -> str:
    assert s.pg.tcp_port is not None
    before = common.metric(s.url, "flywheel_transitions_journaled_total")
    probes: list[str] = []  # a reward posted during it, one after another: how long it took
    with netfault.partition(s.pg.tcp_port):
        deadline = time.monotonic() + outage_s
        while time.monotonic() < deadline:
            probes.append(_probe_reward(s.url))
            time.sleep(max(0.0, min(2.0, deadline - time.monotonic())))
        health = _answered(s.url + "/healthz")
    journaled = common.metric(s.url, "flywheel_transitions_journaled_total") - before
    return (
        f"the proxy journaled {journaled:.0f} during it; /healthz during it: {health}; "
        f"a reward posted every 2 s during it: {', '.join(probes)}"
    )


def _probe_reward(url: str) -> str:
    body = {"episode_id": f"probe-{uuid.uuid4().hex[:8]}", "reward": 1.0}
    started = time.monotonic()
    try:
        r = httpx.post(url + "/v1/rewards", json=body, timeout=120)
        told = str(r.status_code)
    except httpx.HTTPError as e:
        told = type(e).__name__
    return f"{told} in {time.monotonic() - started:.0f} s"


def vllm_partition(s: Stack, outage_s: float, traffic: Traffic) -> str:
    port = int(s.fakes[0].url.rsplit(":", 1)[1])
    ejected = common.metric(s.url, "flywheel_replica_ejections_total")
    acknowledged, told = len(traffic.transitions), sum(traffic.errors.values())
    with netfault.partition(port):
        time.sleep(outage_s)
        up = common.metric(s.url, "flywheel_replica_up", f'replica="{s.fakes[0].url}')
        health = _answered(s.url + "/healthz")
        during = len(traffic.transitions) - acknowledged, sum(traffic.errors.values()) - told
    ejections = common.metric(s.url, "flywheel_replica_ejections_total") - ejected
    healed = time.monotonic()
    while time.monotonic() - healed < 30 and not common.metric(
        s.url, "flywheel_replica_up", f'replica="{s.fakes[0].url}'
    ):
        time.sleep(0.2)
    back = time.monotonic() - healed
    return (
        f"the cut replica ejected {ejections:.0f} times, in rotation at the end: {up:.0f}, "
        f"back {back:.1f} s after the heal; during it {during[0]} transitions acknowledged "
        f"(the other replica), {during[1]} calls told otherwise; /healthz: {health}"
    )


def _answered(url: str) -> str:
    started = time.monotonic()
    try:
        r = httpx.get(url, timeout=10)
        return f"{r.status_code} in {time.monotonic() - started:.1f} s"
    except httpx.HTTPError as e:
        return f"{type(e).__name__} after {time.monotonic() - started:.1f} s"


# --- two faults at once ------------------------------------------------------------------------


def pg_stop_proxy_term(s: Stack, outage_s: float) -> str:
    assert s.proxy is not None
    s.pg.stop()
    time.sleep(outage_s / 2)
    s.proxy.process.send_signal(signal.SIGTERM)
    code = s.proxy.process.wait(timeout=90)
    s.start_proxy()  # while Postgres is still down: journal-only until it answers
    time.sleep(outage_s / 2)
    s.pg.start()
    return f"the proxy exited {code} and started again with Postgres down"


def journal_full_proxy_kill(s: Stack, outage_s: float) -> str:
    assert s.proxy is not None
    s.pg.stop()
    time.sleep(max(1.0, outage_s / 4))
    held = common.metric(s.url, "flywheel_writer_unsaved_transitions")  # queued + in flight
    errors = common.metric(s.url, "flywheel_journal_errors_total")
    s.proxy.process.send_signal(signal.SIGKILL)
    s.proxy.process.wait()
    s.pg.start()
    s.start_proxy()
    return (
        f"journal writes failed {errors:.0f} times; the writer held {held:.0f} transitions in "
        "memory at the kill (the bound on what it can lose)"
    )


# --- the proxy out of memory -------------------------------------------------------------------


GROUP = CGROUP_ROOT / f"flywheel-chaos-{os.getpid()}"


@contextlib.contextmanager
def memory_cgroup(limit_mb: int, work: Path) -> Iterator[str]:
    """A v1 memory cgroup limited to `limit_mb` (swap off); yields an interpreter that runs in
    it, for the stack's proxy (Stack.proxy_python): it joins the group before it allocates
    anything, as cgroup v1 charges a process's memory where it was when it allocated it."""
    GROUP.mkdir(exist_ok=True)
    python = work / f"python-in-{GROUP.name}"
    try:
        (GROUP / "memory.limit_in_bytes").write_text(str(limit_mb * 2**20))
        with contextlib.suppress(OSError):  # (absent without swap accounting)
            (GROUP / "memory.memsw.limit_in_bytes").write_text(str(limit_mb * 2**20))
        python.write_text(
            f'#!/bin/sh\necho $$ > {GROUP / "cgroup.procs"}\nexec {sys.executable} "$@"\n'
        )
        python.chmod(0o755)
        yield str(python)
    finally:
        for pid in (GROUP / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # back to the root group, or gone
                (CGROUP_ROOT / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            GROUP.rmdir()
        python.unlink(missing_ok=True)


def proxy_oom(s: Stack, seconds: float, limit_mb: int) -> str:
    assert s.proxy is not None
    proc = s.proxy.process
    start_rss = psutil.Process(proc.pid).memory_info().rss / 2**20
    rss: list[tuple[float, float]] = []
    started = time.monotonic()
    while (t := time.monotonic() - started) < seconds and proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            rss.append((t, psutil.Process(proc.pid).memory_info().rss / 2**20))
        time.sleep(1.0)
    failcnt = int((GROUP / "memory.failcnt").read_text())
    peak = int((GROUP / "memory.max_usage_in_bytes").read_text()) / 2**20
    oom = (GROUP / "memory.oom_control").read_text().split()
    kills = int(oom[oom.index("oom_kill") + 1]) if "oom_kill" in oom else -1
    code = proc.poll()
    if code is not None:  # killed: a new one replays what its predecessor journaled
        s.start_proxy()
    curve = ", ".join(f"{t:.0f} s {m:.0f}" for t, m in rss[:: max(1, len(rss) // 8)])
    return (
        f"limit {limit_mb} MiB; RSS MiB {start_rss:.0f} at the start, then {curve}; "
        f"peak {max((m for _, m in rss), default=0):.0f} (the group's {peak:.0f}); "
        f"failcnt {failcnt}, oom_kill {kills}; "
        + (f"the proxy died ({code}) after {rss[-1][0]:.0f} s" if code is not None else "alive")
    )
