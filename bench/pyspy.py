"""py-spy on a running server, and its collapsed stacks (--native) reduced to shares of the busy
samples: own time per function and per area (a package or a native bucket), total time per
Python function. bench/scaling.py --profile runs it on the proxy under load; on a capture of
one's own:

    PYTHONPATH=. .venv/bin/python -m bench.pyspy RAW_STACKS     # the summary, as JSON
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fakes.processes import ROOT


def py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def start_profile(pid: int, seconds: float, out: Path, rate: int = 250) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` for `seconds` into collapsed stacks (--format raw).

    Blocking (the default): py-spy pauses the process for each sample, a few percent of its time
    at this rate; --nonblocking gave torn stacks that do not start at the root. --native shows
    where the C code goes (socket syscalls, the garbage collector), not only `Runner.run`.
    """
    exe = py_spy()
    if exe is None:
        raise SystemExit("py-spy not found: pip install py-spy (the dev extra has it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds)))]
    argv += ["--rate", str(rate), "--format", "raw", "--native", "-o", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _frame_name(frame: str) -> str:
    """`handle (proxy/forward.py:123)` -> `handle (proxy/forward.py)`: functions, not lines."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0].rstrip(")")
    for marker in ("site-packages/", "lib/python3.11/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    if name.startswith("0x"):  # an unsymbolised address: memcpy, malloc and the like
        name = "<unsymbolised>"
    return f"{name} ({path})" if path else name


def _is_python(frame: str) -> bool:
    return frame.endswith(".py)")


def _area(frame: str) -> str:
    """Where a frame's time goes: a package (`proxy`, `starlette`, ...), or a native bucket."""
    path = frame.partition(" (")[2].rstrip(")")
    if _is_python(frame):
        return path.split("/", 1)[0].removesuffix(".py")
    if path.startswith("libc"):
        return "syscalls/libc"
    if path.startswith("libpython") or path.endswith((".h", ".c")):
        return "CPython/C extensions"
    return path.split("/", 1)[0] or "<native>"  # orjson/orjson.cpython-311-...so -> orjson


# With --native, py-spy cannot tell an idle thread from a busy one: a thread-pool worker waiting
# for work shows as unsymbolised libc under this frame. Such samples are idle, not cost.
IDLE_FRAMES = ("PyThread_acquire_lock_timed", "epoll_wait", "epoll_pwait")


def _stacks(raw: Path) -> Iterator[tuple[list[str], int]]:
    """Busy stacks only (see IDLE_FRAMES), frames as `_frame_name`s, with their sample counts."""
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        if any(f.startswith(IDLE_FRAMES) for f in frames):
            continue
        yield [_frame_name(f) for f in frames], int(count_text)


@dataclass
class Profile:
    """py-spy's collapsed stacks (with --native) reduced to shares of the busy samples."""

    samples: int
    own: list[tuple[str, float]]  # leaf frames (native ones too: syscalls, gc), largest first
    total: dict[str, float]  # Python functions anywhere on the stack
    areas: list[tuple[str, float]]  # own time by package / native bucket


def summarise_profile(raw: Path) -> Profile:
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    samples = 0
    for frames, count in _stacks(raw):
        samples += count
        own[frames[-1]] += count
        areas[_area(frames[-1])] += count
        for name in {f for f in frames if _is_python(f)}:
            total[name] += count
    n = samples or 1
    return Profile(
        samples,
        [(f, c / n) for f, c in own.most_common()],
        {f: c / n for f, c in total.items()},
        [(a, c / n) for a, c in areas.most_common()],
    )


if __name__ == "__main__":
    print(json.dumps(dataclasses.asdict(summarise_profile(Path(sys.argv[1]))), indent=1))
