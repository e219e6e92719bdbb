"""stoker.server: the data server. Needs no torch.

Run it with `stoker serve --config CONFIG.yaml`; embed it with `load_config` and `serve`;
start one as a child process with `ServerProcess`.
Names load lazily: worker processes import this package and need none of the front end.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Config", "ConfigError", "ServerProcess", "StartError", "load_config", "serve",
           "write_config"]


def __getattr__(name: str) -> Any:
    if name == "serve":
        from ._app import serve

        return serve
    if name in ("Config", "ConfigError", "load_config"):
        from . import _config

        return getattr(_config, name)
    if name == "StartError":
        from ._errors import StartError

        return StartError
    if name in ("ServerProcess", "write_config"):
        from . import _process

        return getattr(_process, name)
    raise AttributeError(f"module 'stoker.server' has no attribute {name!r}")
