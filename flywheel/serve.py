"""The three processes: `flywheel proxy`, `flywheel trainer`, `flywheel judge`. Each takes every
field of its settings class as a flag (flywheel/options.py), runs until stopped, and on the way
out lets go of the embedded PostgreSQL it used, if any: the last process using that server stops
it, and one that leaves it running says so and how to stop it (see `release`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

from core import embedded
from flywheel.options import add_settings, build, configure_logging
from flywheel.stopping import stopped_by_signals
from judge.config import JudgeSettings
from proxy.config import ProxySettings
from trainer.config import TrainerSettings

T = TypeVar("T")
USAGE = "%(prog)s [flags: every setting, below]"


def proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = USAGE
    add_settings(parser, ProxySettings)


def proxy(args: argparse.Namespace) -> None:
    """run the recording proxy in front of vLLM"""
    settings = build(ProxySettings, args)
    configure_logging(settings.log_level)
    if not settings.upstream:
        sys.exit("flywheel proxy: no upstream; pass --upstream URL or set FLYWHEEL_UPSTREAM")
    from proxy.main import run

    until_stopped(lambda: run(settings))


def trainer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = USAGE
    add_settings(parser, TrainerSettings)


def trainer(args: argparse.Namespace) -> None:
    """run the GRPO + LoRA trainer"""
    settings = build(TrainerSettings, args)  # before torch is imported: bad values fail fast
    configure_logging(settings.log_level)
    from trainer.turns import run

    until_stopped(lambda: run(settings))


def judge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = USAGE
    parser.add_argument("--once", action="store_true", help="one round, then exit")
    add_settings(parser, JudgeSettings)


def judge(args: argparse.Namespace) -> None:
    """score unrewarded episodes with an LLM judge through litellm (judge/)"""
    settings = build(JudgeSettings, args)
    configure_logging(settings.log_level)
    from judge.worker import run  # (litellm on first use: the judge install)

    done = until_stopped(lambda: run(settings, once=args.once))
    if done is not None:
        print(
            f"judged {done.judged} episodes in {done.groups} groups ({done.failed} failed, "
            f"{done.skipped} skipped), ${done.cost_usd:.4f}"
        )
        if done.errors:
            sys.exit(f"flywheel judge: {done.errors[0]}")


def until_stopped(serve: Callable[[], T]) -> T | None:
    """`serve()` until it returns or a signal stops it (None); then let go of the embedded
    PostgreSQL it used."""
    with stopped_by_signals():
        try:
            return serve()
        finally:
            release()
    return None


def release() -> None:
    """Let go of the embedded PostgreSQL this process used (no-op with a database URL).

    Chosen over leaving it running: an embedded server is a convenience of one machine that
    nobody should have to remember to stop. Over stopping it outright: a trainer (or a second
    proxy) on the same FLYWHEEL_HOME may still be using it; the last one out stops it."""
    for said in embedded.release():
        print(f"flywheel: {said}", file=sys.stderr, flush=True)
