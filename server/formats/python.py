"""`format: python`: the user's own map-style dataset, built by `factory(**options)`."""

from __future__ import annotations

import importlib
from typing import Any


def open_python(cfg: Any) -> Any:
    module_name, _, attr = cfg.factory.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"factory {cfg.factory!r}: cannot import {module_name!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"factory {cfg.factory!r}: {module_name!r} has no {attr!r}") from None
    dataset = obj(**cfg.options)
    for method in ("__len__", "__getitem__"):
        if not hasattr(dataset, method):
            raise ValueError(
                f"factory {cfg.factory!r} returned {type(dataset).__name__}, which has no {method}")
    return dataset
