"""`format: python` datasets whose data differs between processes, for tests/test_fingerprint.py
(servers started by the tests have this folder on PYTHONPATH, see conftest.py)."""

from __future__ import annotations

import os

import numpy as np


class Versioned:
    """n samples of `version`; its fingerprint() is the version, or the process id with
    `per_process` (each worker then sees other data: as if the data changed while they
    opened it)."""

    def __init__(self, n: int = 16, version: str = "1", per_process: bool = False) -> None:
        self.n, self.version, self.per_process = n, version, per_process

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": np.full(2, i, np.int64)}

    def fingerprint(self) -> str:
        return f"pid {os.getpid()}" if self.per_process else self.version
