"""What the demo agents (demo/agent.py, demo/tool_agent.py, demo/sql_agents.py) share: the line
each prints per round (the reward bar of `flywheel up`'s screen) and their command line."""

from __future__ import annotations

import argparse


def print_line(r: int, rewards: list[float], failed: int, *details: str, width: int = 30) -> None:
    """`round   3  reward 0.42 ############   <details>  [FAILED n]`."""
    mean = sum(rewards) / len(rewards)
    print(
        f"round {r:3d}  reward {mean:.2f} {'#' * round(mean * width):<{width}}  "
        + "  ".join(details)
        + (f"  FAILED {failed}" if failed else ""),
        flush=True,
    )


def command_line(description: str, *, rounds: int | None = None) -> argparse.ArgumentParser:
    """--base-url (the proxy's) and --rounds (unset: until stopped)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser
