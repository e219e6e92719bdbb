"""Samples a run leaves out (`RemoteLoader.exclude`): `Excluded`, a set of dataset indices
that travels with the coordinates, so every server drops them from the batches that hold
them (server/order/sampling.py's Exclusion says what that does to a batch).

Threading: plain values.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

# The most indices one run may exclude (the servers' limit: every request carries them).
MAX_EXCLUDED = 100_000


@dataclass(frozen=True)
class Excluded:
    """Sorted, distinct dataset indices, and their digest: `sha256:<hex>` of them as
    little-endian int64 (what the servers check and name the set by)."""

    indices: tuple[int, ...]
    digest: str

    @classmethod
    def union(cls, before: Excluded | None, more: Iterable[Any]) -> Excluded | None:
        """`before`'s indices and `more` (ints >= 0, numpy's included); None if both are
        empty. ValueError naming what is not such an index, or past MAX_EXCLUDED."""
        found = set(before.indices if before is not None else ())
        for i in more:
            try:
                index = -1 if isinstance(i, bool) else operator.index(i)
            except TypeError:
                index = -1
            if index < 0:
                raise ValueError(f"excluded sample indices must be ints >= 0, got {i!r}")
            found.add(index)
        if not found:
            return None
        if len(found) > MAX_EXCLUDED:
            raise ValueError(f"{len(found)} excluded samples: at most {MAX_EXCLUDED} may be "
                             "excluded in one run (each request carries them all)")
        indices = tuple(sorted(found))
        raw = np.asarray(indices, "<i8").tobytes()
        return cls(indices, "sha256:" + hashlib.sha256(raw).hexdigest())
