"""`format: python`: the user's own map-style dataset, built by `factory(**options)`; and the
user's per-sample `transform:`, which any format may have."""

from __future__ import annotations

import importlib
from typing import Any

from .._sampling import FIRST_EPOCH, EpochKey
from ._contract import DatasetParts


def load_callable(spec: str, what: str) -> Any:
    """The object `module:attr.path` names; ValueError saying which part is missing."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what} {spec!r}: {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is a {type(obj).__name__}, not callable")
    return obj


def open_python(cfg: Any) -> Any:
    dataset = load_callable(cfg.factory, "factory")(**cfg.options)
    for method in ("__len__", "__getitem__"):
        if not hasattr(dataset, method):
            raise ValueError(
                f"factory {cfg.factory!r} returned {type(dataset).__name__}, which has no {method}")
    return dataset


class WithTransform:
    """A dataset whose samples go through the user's `transform(sample, rng)` after the
    format's own decoding; rng is seeded by (seed, epoch, index), apart from the format's."""

    def __init__(self, dataset: Any, spec: str) -> None:
        self.dataset = dataset
        self.spec = spec
        self.fn = load_callable(spec, "transform")
        self._read = DatasetParts.of(dataset).read  # the format's sample(i, key), or [i]

    def __len__(self) -> int:
        return len(self.dataset)

    def sample(self, index: int, key: EpochKey) -> Any:
        out = self.fn(self._read(index, key), key.rng(index, stream=1))
        if not isinstance(out, dict):
            raise TypeError(f"transform {self.spec!r} returned {type(out).__name__}, "
                            "expected a dict of fields")
        return out

    def __getitem__(self, index: int) -> Any:
        return self.sample(index, FIRST_EPOCH)

    def __getattr__(self, name: str) -> Any:
        # The optional parts but `sample` (source_of, objects_of, ...; see DatasetParts): the
        # format's own, where it has them.
        return getattr(self.__dict__["dataset"], name)
