"""`stoker check CONFIG`: validate a config and open every dataset the way a worker opens it
(in this process: the format reader, the fingerprint, sample 0 read and collated), without
opening a port. One line per dataset; the exit code says whether `stoker serve` would start.

    0  the config is valid and every dataset opened
    1  a dataset did not open, or the token or TLS files do not load (the line names which)
    2  the config is invalid (`config error in FILE: ...`, as `stoker serve` says it)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from .._config import ConfigError, load_config


def _fields(fields: list[tuple[str, str, tuple[int, ...]]]) -> str:
    return ", ".join(f"{name} {dtype}{list(shape) if shape else ''}"
                     for name, dtype, shape in fields)


def open_one(name: str, config: Any, cache: Any) -> str:
    """What dataset `name` is, in a few words, once opened and its sample 0 read; raises what
    the open or the read raised."""
    from ..formats import DatasetParts, open_dataset
    from ..order.fingerprint import fingerprint
    from ..pool.batch import probe_fields

    parts = DatasetParts.of(open_dataset(name, config, cache))
    digest = fingerprint(config.datasets[name], parts).short()
    fields = probe_fields(parts)  # reads sample 0, as the server's first worker does
    at = f"snapshot {parts.snapshot}, " if parts.snapshot else ""  # a lake table's, now
    said = f"{at}{len(parts.dataset)} samples, {digest}; fields: {_fields(fields)}"
    # A format that renders its samples (chat) shows the first ones as the model sees them.
    preview = getattr(parts.dataset, "preview", None)
    return said + "".join(f"\n        {line}" for line in (preview() if preview else []))


def _server_files(config: Any) -> list[str]:
    """Problems with the token and TLS files `stoker serve` reads at start."""
    from .._errors import StartError
    from ..front.auth import read_token

    problems = []
    try:
        read_token(config.server)
    except StartError as e:
        problems.append(str(e))
    if config.server.tls is not None:
        from ..front import tls

        try:
            tls.server_context(config.server.tls)
        except StartError as e:
            problems.append(str(e))
    return problems


def check(path: str | Path) -> int:
    try:
        config = load_config(path)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    s = config.server
    print(f"{path}: valid; would serve gRPC on {s.host}:{s.port}, HTTP on {s.host}:"
          f"{s.http_port}, {len(config.datasets)} dataset"
          f"{'s' if len(config.datasets) > 1 else ''}", flush=True)
    failed = 0
    for problem in _server_files(config):
        failed += 1
        print(f"FAIL  server: {problem}", flush=True)
    cache = None
    if any(str(getattr(c, "source", "")).startswith("s3://") for c in config.datasets.values()):
        from ..sources.cache import DiskCache

        cache = DiskCache(config.cache.dir, int(config.cache.max_bytes))
    width = max(len(n) for n in config.datasets)
    for name, cfg in config.datasets.items():
        started = time.monotonic()
        try:
            said = open_one(name, config, cache)
        except Exception as e:  # the user's code and data: anything can fail here
            failed += 1
            print(f"FAIL  {name:<{width}}  {cfg.format}: dataset {name!r}: "
                  f"{type(e).__name__}: {e}", flush=True)
            continue
        print(f"ok    {name:<{width}}  {cfg.format}: {said} "
              f"({time.monotonic() - started:.1f} s)", flush=True)
    if failed:
        print(f"{path}: {failed} problem{'s' if failed > 1 else ''}; `stoker serve` would not "
              "start", file=sys.stderr)
        return 1
    return 0
