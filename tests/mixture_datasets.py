"""Small map-style datasets for tests/test_mixture.py, loaded through `format: python`."""

from __future__ import annotations

import numpy as np


class Named:
    """Sample i: `name` float32[3] = arange(3) + i (so x[0] is the component's own index),
    and `label` = i % 7."""

    def __init__(self, n: int, name: str = "x") -> None:
        self.n, self.name = n, name

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {self.name: np.arange(3, dtype=np.float32) + i, "label": i % 7}


def named(n: int, name: str = "x") -> Named:
    return Named(n, name)
