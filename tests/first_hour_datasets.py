"""Datasets as a new user already has them (torch Datasets returning tuples and tensors),
served through `format: python` by tests/test_first_hour_server.py."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class Pets(Dataset):
    """The torchvision shape: (image tensor, label int)."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 4, 4), float(i)), i % 3


class Plain(Pets):
    """One tensor per sample (an autoencoder's dataset), needing grad, as a model's output may."""

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        return torch.arange(4, dtype=torch.float32).add(i).requires_grad_()


class Grid:
    """An array-like (as a PIL image or a jax array is): numpy reads it through __array__."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.full((2, 2), self.i, dtype=np.uint8)


class Mixed(Pets):
    """A dict of tensors, numpy and Python values, and an array-like."""

    def __getitem__(self, i: int) -> dict:  # type: ignore[override]
        return {"x": torch.tensor([i, i + 1], dtype=torch.int32), "w": np.float32(i / 2),
                "ok": i % 2 == 0, "m": Grid(i)}


class Captions(Pets):
    """Sample 5 carries a caption string, which cannot be batched."""

    def __getitem__(self, i: int) -> tuple:  # type: ignore[override]
        return torch.zeros(2), ("a cat" if i == 5 else i)


def _decode(record: int) -> None:
    raise ValueError(f"record {record} is truncated")


class Broken(Pets):
    """Sample 7 raises in the user's own helper: its traceback must reach the client."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == 7:
            _decode(i)
        return super().__getitem__(i)


class Heavy(Pets):
    """Samples of 4 KiB: a batch of them is over a small max_batch_bytes."""

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        return torch.zeros(1024)


def _connect(url: str) -> None:
    raise ConnectionError(f"cannot reach {url}")


def exploding(url: str = "db://nowhere") -> Pets:
    """A factory that fails in the user's own helper: its traceback goes to the server's log."""
    _connect(url)
    return Pets()
