"""The `stoker` command.

    stoker serve --config FILE      run a data server                       (the server extra)
    stoker check CONFIG             validate a config, open every dataset   (the server extra)
    stoker datasets ADDRESS         what a running server serves            (the client extra)
    stoker inspect ADDRESS DATASET  one batch of a dataset, summarised      (the client extra)
    stoker stats HTTP_ADDRESS       a running server's /v1/stats            (the client extra)
    stoker autoscale --config FILE --addresses FILE
                                    local servers started and drained on the
                                    data stall their trainers report        (the server extra)

This module imports nothing beyond the standard library at its top: a trainer node has only
the client extra (no pyyaml, pydantic, FastAPI), and the commands it runs must start there.
Each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

# Imported by the server-only commands; the packages that only the server extra brings.
SERVER_EXTRA = frozenset({"yaml", "pydantic", "pydantic_core", "fastapi", "starlette",
                          "uvicorn", "prometheus_client", "grpc_health", "grpc_reflection",
                          "zstandard", "h11"})
SERVER_EXTRA_HINT = 'pip install ".[server]" (from a checkout of stoker)'


def _needs_server_extra(command: str, e: ModuleNotFoundError) -> int:
    """One line saying which extra `command` needs, exit code 2; re-raises any other missing
    module (a bug, not an install choice)."""
    if (e.name or "").split(".")[0] not in SERVER_EXTRA:
        raise e
    print(f"stoker {command} needs the server extra (no module {e.name!r} here): "
          f"{SERVER_EXTRA_HINT}", file=sys.stderr)
    return 2


def _serve(args: argparse.Namespace) -> int:
    try:
        import asyncio
        import gc

        from ._app import serve
        from ._config import ConfigError, load_config
        from ._errors import StartError
    except ModuleNotFoundError as e:
        return _needs_server_extra("serve", e)
    try:
        config = load_config(args.config, host=args.host, port=args.port,
                             http_port=args.http_port, workers=args.workers)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    # This process is the server alone: what it imported lives as long as it does, so the
    # cyclic collector leaves it out of its passes from now on (perf: the front end spent
    # about a tenth of its CPU walking those objects at 64 KiB batches).
    gc.freeze()
    try:
        asyncio.run(serve(config))
    except StartError as e:
        print(f"cannot start {args.config}: {e}", file=sys.stderr)
        return 1
    return 0


def _check(args: argparse.Namespace) -> int:
    try:
        from .tools.check import check
    except ModuleNotFoundError as e:
        return _needs_server_extra("check", e)
    return check(args.config)


def version() -> str:
    """The installed distribution's version (its metadata, not a constant that can drift)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("stoker")
    except PackageNotFoundError:  # run from a folder that was never installed
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    from .tools import autoscale, inspect, stats_view

    p = argparse.ArgumentParser(prog="stoker", description="Remote data serving for ML "
                                "training.")
    p.add_argument("--version", action="version", version=f"stoker {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run a data server (server extra)")
    serve.add_argument("--config", required=True, help="YAML config file")
    serve.add_argument("--host", help="address to bind (default from config, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="gRPC port (0: any free port)")
    serve.add_argument("--http-port", type=int, help="HTTP control port (0: any free port)")
    serve.add_argument("--workers", type=int, help="worker processes (default: one per core)")
    serve.add_argument("--log-level", default="INFO", type=str.upper,
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check", help="validate a config and open every dataset, without "
                           "serving (server extra)")
    check.add_argument("config", help="YAML config file")
    check.set_defaults(func=_check)
    inspect.add_commands(sub)
    stats_view.add_command(sub)
    autoscale.add_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args: Any = parser().parse_args(argv)
    if args.command not in ("serve", "check"):
        # gRPC's C core logs a failed handshake to stderr itself (before grpc is imported:
        # it reads this once); these commands say what went wrong in one line of their own.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    logging.basicConfig(level=getattr(args, "log_level", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
