"""How a long-running command stops: every signal that ends it (SIGTERM from `timeout`, systemd or
a container stop; SIGINT, Ctrl-C; SIGHUP, a closed terminal) unwinds it like an exception, so
each `finally` and `with` block stops what it started, in the reverse order of starting.

    with stopped_by_signals():
        run_until_stopped()          # a signal raises Stopped (a KeyboardInterrupt) in it

The first signal starts the orderly stop and later ones are ignored: a second SIGTERM must not cut
it short and leave the rest running. SIGHUP is turned into SIGTERM, so that a process with a
graceful SIGTERM of its own (uvicorn's, the trainer's) also stops gracefully on it. Stopped by
SIGTERM, the command then exits as killed by it, as supervisors expect; by Ctrl-C, normally.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A signal asked the command to stop: Ctrl-C's exception, so code that already stops
    cleanly on Ctrl-C (the trainer gives its claims back) does the same on SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    stopped_by = None

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopped_by
        for each in STOPPING:
            signal.signal(each, signal.SIG_IGN)
        stopped_by = signum
        raise Stopped(signum)

    def hang_up(_signum: int, _frame: FrameType | None) -> None:
        signal.raise_signal(signal.SIGTERM)

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, stop),
        signal.SIGTERM: signal.signal(signal.SIGTERM, stop),
        signal.SIGHUP: signal.signal(signal.SIGHUP, hang_up),
    }
    try:
        yield
    except KeyboardInterrupt:
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stopped_by == signal.SIGTERM:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
