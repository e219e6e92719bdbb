"""Tests with the real training frameworks (Lightning, HF Trainer, DCP, Ray): tests/frameworks.

They run from .venv-frameworks (`make test-frameworks`), which has the framework packages and
no torchvision (Lightning imports it when installed; the dev venv's is a CUDA build that fails
beside the CPU torch). Every test here is marked `frameworks`. From the dev venv the folder is
left out of collection (tests/conftest.py), since none of these packages is installed there.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/frameworks/" in str(item.path):
            item.add_marker(pytest.mark.frameworks)
