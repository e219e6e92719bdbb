"""`format: python` datasets whose data differs between servers or processes, for
tests/test_fingerprint.py and tests/test_resume.py (servers started by the tests have this
folder on PYTHONPATH, see conftest.py)."""

from __future__ import annotations

import os
import time

import numpy as np


class Versioned:
    """n samples of data `version` (each sample says which); fingerprint() is the version, or
    the process id with `per_process` (each worker then sees other data: as if the data
    changed while they opened it). `delay`: seconds of work per sample."""

    def __init__(self, n: int = 16, version: int = 1, per_process: bool = False,
                 delay: float = 0.0) -> None:
        self.n, self.version, self.per_process = n, version, per_process
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.delay:
            time.sleep(self.delay)
        return {"x": np.full(2, i, np.int64), "version": np.int64(self.version)}

    def fingerprint(self) -> str:
        return f"pid {os.getpid()}" if self.per_process else f"version {self.version}"
