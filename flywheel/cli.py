"""`flywheel`: the console script.

    flywheel proxy --upstream http://127.0.0.1:8001 [--host H] [--port P]
    flywheel trainer --model DIR --vllm URL [--vllm URL ...] --adapters-dir DIR
    flywheel judge [--once]      # LLM-judge rewards for unrewarded episodes
    flywheel adapters list [--lineage L]          # versions by lineage, the open canaries
    flywheel adapters canaries [--lineage L]      # every canary: promoted, rolled back, open
    flywheel adapters activate N --vllm URL [--vllm URL ...]   # rollback, in N's own lineage
    flywheel adapters activate 0 --lineage L --vllm URL         # lineage L back on the base model
    flywheel adapters pin N --vllm URL [--note WHY]   # activate N and hold its lineage there
    flywheel adapters unpin [--lineage L]             # let the trainer publish to it again
    flywheel keys create --tenant T [--scopes infer,reward,read] [--name N]   # prints the key once
    flywheel keys list | flywheel keys revoke ID
    flywheel eval add NAME --lineage L --from items.jsonl [--scorer exact|python:mod:fn]
    flywheel eval list [--lineage L] | flywheel eval remove NAME --lineage L
    flywheel export OUT.jsonl|OUT.parquet [--kind transitions|sft|pairs] [--tokens] [filters]
    flywheel retain --days N [--archive DIR] [--include-untrained] [--dry-run]   # drop old days
    flywheel status [--json]            # lineages, queue, last steps, the share trained and why
    flywheel migrate [--database-url URL]
    flywheel up [--port P] [--task calc|calc-tools|sql|bfcl] [--model M]   # the whole local loop
    flywheel model M                    # the directory M resolves to (converted once)
    flywheel demo-model DIR             # generate the tiny demo model

`flywheel COMMAND --help` lists every setting of the command's process (proxy/config/,
trainer/config/, judge/config.py, core/settings.py) as a flag with its FLYWHEEL_* variable,
default and help text; flags win over variables. This package sits above all the others: the
proxy, the trainer and the demo never import each other, only `core`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from core import embedded
from flywheel import adapters, data, evals, keys, local, serve, status


@dataclass(frozen=True)
class Command:
    name: str
    arguments: Callable[[argparse.ArgumentParser], None]  # adds the command's flags
    run: Callable[[argparse.Namespace], None]  # its docstring's first line is its help

    @property
    def help(self) -> str:
        return (self.run.__doc__ or "").split("\n")[0]


COMMANDS = (
    Command("proxy", serve.proxy_arguments, serve.proxy),
    Command("trainer", serve.trainer_arguments, serve.trainer),
    Command("judge", serve.judge_arguments, serve.judge),
    Command("adapters", adapters.arguments, adapters.run),
    Command("keys", keys.arguments, keys.run),
    Command("eval", evals.arguments, evals.run),
    Command("export", data.export_arguments, data.export_rows),
    Command("retain", data.retain_arguments, data.retain),
    Command("status", status.arguments, status.run),
    Command("migrate", data.migrate_arguments, data.migrate),
    Command("up", local.up_arguments, local.up),
    Command("model", local.model_arguments, local.model),
    Command("demo-model", local.demo_model_arguments, local.demo_model),
)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    finally:  # the embedded PostgreSQL a command used stops with the last process using it
        embedded.release()


def parser() -> argparse.ArgumentParser:
    """`flywheel` with a subcommand per entry of COMMANDS; `args.run` is the chosen one's."""
    flywheel = argparse.ArgumentParser(prog="flywheel", description=__doc__.split("\n\n")[0])
    subparsers = flywheel.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.arguments(sub)
        sub.set_defaults(run=command.run)
    return flywheel


if __name__ == "__main__":
    main()
