"""Tests with the real training frameworks (Lightning, HF Trainer, DCP, Ray): tests/frameworks.

They run from .venv-frameworks (`make test-frameworks`), which has the framework packages and
no torchvision (Lightning imports it when installed; the dev venv's is a CUDA build that fails
beside the CPU torch). Every test here is marked `frameworks`. From the dev venv the folder is
left out of collection (tests/conftest.py), since none of these packages is installed there.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from stoker.server import ServerProcess


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/frameworks/" in str(item.path):
            item.add_marker(pytest.mark.frameworks)


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
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture
def run_example() -> Callable[..., subprocess.CompletedProcess]:
    """run_example(name, *args): examples/`name` run as a user runs it, by this venv's
    Python; AssertionError with its output unless it exits 0."""
    return _run_example
