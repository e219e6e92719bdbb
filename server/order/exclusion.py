"""Samples a run leaves out: a set of dataset indices dropped from every batch that holds
them, the rest of the order unchanged.

Positions are not renumbered: batch k is the same slice of the epoch's order with or without
an exclusion, less the excluded samples it held (so it has that many fewer rows). That is
what keeps resume, seek and elastic resume exact with an exclusion: consumed positions are
still a prefix of the order. The set travels with the coordinates (the list, bounded by
MAX_EXCLUDED, and its digest, which names it in cache keys and proves the list whole).

Threading: plain values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from .sampling import CoordinateError

# Indices one run may exclude: a request carries them all (10 bytes each at most), and
# gRPC's default message limit is 4 MiB.
MAX_EXCLUDED = 100_000


def digest_of(indices: np.ndarray) -> str:
    """`sha256:<hex>` of the sorted, distinct indices as little-endian int64 (the client
    computes the same: client/position/exclusions.py)."""
    return "sha256:" + hashlib.sha256(np.asarray(indices, "<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class Exclusion:
    """A checked set of excluded sample indices; equal (and hashed) by its digest."""

    digest: str
    indices: np.ndarray = field(compare=False, hash=False, repr=False)  # sorted, distinct

    @classmethod
    def of(cls, indices: list[int], digest: str, num_samples: int) -> Exclusion | None:
        """The exclusion a request names (None for none); CoordinateError naming `excluded`
        when it is too long, holds an index out of the dataset, is not sorted and distinct,
        or `digest` is not its digest."""
        if not indices and not digest:
            return None
        if len(indices) > MAX_EXCLUDED:
            raise CoordinateError("excluded", f"{len(indices)} indices, at most "
                                              f"{MAX_EXCLUDED} may be excluded")
        arr = np.asarray(indices, dtype=np.int64)
        if len(arr) and (arr[0] < 0 or arr[-1] >= num_samples):
            raise CoordinateError("excluded", f"indices must be in [0, {num_samples}), got "
                                              f"{int(arr.min())}..{int(arr.max())}")
        if len(arr) > 1 and not bool((np.diff(arr) > 0).all()):
            raise CoordinateError("excluded", "indices must be sorted and distinct")
        if digest != digest_of(arr):
            raise CoordinateError("excluded_digest", f"is not the digest of the {len(arr)} "
                                                     "indices sent (sha256 of them as "
                                                     "little-endian int64)")
        arr.flags.writeable = False
        return cls(digest, arr)

    def drop(self, samples: np.ndarray) -> np.ndarray:
        """`samples` without the excluded ones, in their order."""
        return samples[~np.isin(samples, self.indices)]
