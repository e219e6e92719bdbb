"""Tests with the real training frameworks (Lightning, HF Trainer, DCP, Ray): tests/frameworks.

They run from .venv-frameworks (`make test-frameworks`), which has the framework packages and
no torchvision (Lightning imports it when installed; the dev venv's is a CUDA build that fails
beside the CPU torch). Every test here is marked `frameworks`. From the dev venv the folder is
left out of collection (tests/conftest.py), since none of these packages is installed there.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stoker.server import ServerProcess


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/frameworks/" in str(item.path):
            item.add_marker(pytest.mark.frameworks)


@pytest.fixture(autouse=True)
def _ranks_die_with_their_test() -> Iterator[None]:
    """The processes a test started with multiprocessing (a job's ranks) and left running,
    killed when it ends: a test that timed out mid-job leaves ranks blocked in a gloo
    collective, which would outlive it (and hold pytest's exit, which joins them)."""
    before = set(multiprocessing.active_children())
    yield
    left = [p for p in multiprocessing.active_children() if p not in before]
    for p in left:
        p.kill()
    for p in left:
        p.join(30)


@pytest.fixture(scope="session", autouse=True)
def _fork_server_ends_with_the_session() -> Iterator[None]:
    """The fork server a job's ranks fork from (examples/dcp_resume.py: it imported torch)
    and the resource tracker beside it, stopped and waited for when the session ends. Left
    alone, each notices the session's exit by itself and outlives it by seconds on a loaded
    machine: processes left behind for whoever lists them right after the run. (`_stop` is
    what CPython's own tests call; it does nothing where neither was started.)"""
    yield
    multiprocessing.forkserver._forkserver._stop()
    multiprocessing.resource_tracker._resource_tracker._stop()


ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SAMPLES = 240  # dataset "line": 2 ranks x 6 steps x batch 4 leave 192 = 3 x 16 x 4


@pytest.fixture(scope="module")
def line_server(start_server_module: Callable[..., ServerProcess]) -> ServerProcess:
    """A real server for a module's tests: dataset "line" of examples/framework_data.py (what
    the framework examples train on), SAMPLES samples."""
    return start_server_module(
        {"line": {"format": "python", "factory": "framework_data:line",
                  "options": {"n": SAMPLES}}},
        env={"PYTHONPATH": str(EXAMPLES)})


def _run_example(name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # In a session of its own, killed as a whole however the wait ends (its timeout, the
    # test's): the example's ranks are its children, and would outlive it.
    with subprocess.Popen([sys.executable, str(EXAMPLES / name), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # every process of the session has exited
            proc.wait()
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture
def run_example() -> Callable[..., subprocess.CompletedProcess]:
    """run_example(name, *args): examples/`name` run as a user runs it, by this venv's
    Python; AssertionError with its output unless it exits 0."""
    return _run_example
