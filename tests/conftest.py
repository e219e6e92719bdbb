"""Real data servers on free loopback ports, started as child processes.

A server's datasets come from tests/datasets.py (through `format: python`), so every server
gets this folder on PYTHONPATH. Servers are stopped with SIGTERM and must exit 0.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from stoker.server import ServerProcess, write_config

TESTS = Path(__file__).resolve().parent

# The reliability ledger (fixture `ledger`, option --reliability-json): tests/reliability.py
pytest_plugins = ["reliability"]


def server_env(*extra_paths: Path) -> dict[str, str]:
    paths = [str(p) for p in (*extra_paths, TESTS)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {"PYTHONPATH": os.pathsep.join(paths)}


TOY_DATASETS: dict[str, Any] = {
    "toy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 103}},
    "flaky": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 40,
                                                                         "fail_at": [13]}},
    "skippy": {"format": "python", "factory": "toy_datasets:toy", "on_error": "skip",
               "options": {"n": 40, "fail_at": [13, 30]}},
    "ragged": {"format": "python", "factory": "toy_datasets:Ragged", "options": {"n": 10}},
    "crashy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 40,
                                                                          "die_at": 21}},
    "huge": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 8,
                                                                        "huge_at": 6}},
}

StartServer = Callable[..., ServerProcess]

# tests/frameworks needs the training frameworks, installed only in .venv-frameworks
# (`make test-frameworks`, part of `make test`); from any other venv it is not collected.
collect_ignore = [] if importlib.util.find_spec("lightning") else ["frameworks"]


def rss_anon(pid: int) -> int:
    """RssAnon of `pid` and its child processes (a server's workers), in bytes; 0 if gone."""
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _starter(tmp_path: Path) -> Iterator[StartServer]:
    started: list[ServerProcess] = []

    def start(datasets: dict[str, Any], workers: int = 1, server: dict[str, Any] | None = None,
              env: dict[str, str] | None = None, wrap: Sequence[str] = (),
              cache: dict[str, Any] | None = None, host: str = "127.0.0.1") -> ServerProcess:
        config = write_config(tmp_path / f"config-{len(started)}.yaml",
                              {"server": server or {}, "cache": cache or {},
                               "datasets": datasets})
        proc = ServerProcess(config, workers=workers, env=env or server_env(), wrap=wrap,
                             host=host)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        assert proc.stop() == 0, proc.stderr


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[StartServer]:
    """start_server(datasets, workers=1, server={...}, cache={...}, wrap=(...), host=...) -> a
    ready ServerProcess (on another host: wrap=host.wrap, host=host.ip, tests/hosts.py)."""
    yield from _starter(tmp_path)


@pytest.fixture(scope="module")
def start_server_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """Like start_server, for servers that a whole test module shares."""
    yield from _starter(tmp_path_factory.mktemp("servers"))


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for a module's tests: the toy datasets, two workers."""
    config = write_config(tmp_path_factory.mktemp("toy") / "config.yaml",
                          {"datasets": TOY_DATASETS})
    with ServerProcess(config, workers=2, env=server_env()) as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, proc.stderr
