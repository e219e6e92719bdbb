"""The `stoker` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from ._config import ConfigError, load_config
from ._workers import StartError


def _serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, host=args.host, port=args.port,
                             http_port=args.http_port, workers=args.workers)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from ._app import serve

    try:
        asyncio.run(serve(config))
    except StartError as e:
        print(f"cannot start {args.config}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stoker", description="Remote data serving for ML "
                                     "training.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run a data server")
    serve.add_argument("--config", required=True, help="YAML config file")
    serve.add_argument("--host", help="address to bind (default from config, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="gRPC port (0: any free port)")
    serve.add_argument("--http-port", type=int, help="HTTP control port (0: any free port)")
    serve.add_argument("--workers", type=int, help="worker processes (default: one per core)")
    serve.add_argument("--log-level", default="INFO", type=str.upper,
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")
    serve.set_defaults(func=_serve)
    from ._inspect import add_commands

    add_commands(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
