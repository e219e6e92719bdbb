"""A `format: python` dataset with a deterministic `prepare` and a random `transform`, for
tests/test_prefix_cache.py (the server imports this module: tests/ is on its PYTHONPATH)."""

from __future__ import annotations

from typing import Any

import numpy as np


class Encoded:
    """Sample i: raw bytes (which only `prepare` makes into arrays) and its label."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        return np.full(40, i, np.uint8).tobytes() + bytes(range(24)), i


def prepare(raw: tuple[bytes, int]) -> dict[str, Any]:
    data, label = raw
    pixels = np.frombuffer(data, np.uint8).astype(np.float32).reshape(8, 8)
    return {"x": np.sqrt(pixels), "label": label, "flag": label % 2 == 0}


def jitter(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return {**sample, "x": sample["x"] + rng.random(sample["x"].shape, dtype=np.float32)}


class OwnSample(Encoded):
    """Its samples may change with the epoch: `prepare` cannot take them."""

    def sample(self, i: int, key: Any) -> tuple[bytes, int]:
        return self[i]
