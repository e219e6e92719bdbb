"""`Listing`: the objects a storage listed, by key, as first seen (what a dataset's fingerprint
covers and what reads are checked against), each an `ObjectInfo`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

# Objects added one by one (a key read before any listing named it) wait in a dict; past this
# many they join the arrays.
RECENT = 4096


@dataclass(frozen=True)
class ObjectInfo:
    """One object a storage lists."""

    key: str  # relative to the storage root, '/'-separated
    size: int
    version: str  # changes when the object's bytes change (S3 ETag; local mtime and size)


class Listing:
    """Key -> ObjectInfo, first seen wins. Held as sorted fixed-width byte arrays, tens of bytes
    an object rather than the hundreds of a dict of dataclasses: every worker lists the
    dataset, and a folder may hold millions of files.

    Threading: add/update from one thread at a time (the storage's, under its lock for S3);
    lookups may race them and then miss an object added meanwhile, never return a wrong one."""

    def __init__(self) -> None:
        # Keys (utf-8, sorted: byte order is code point order), sizes, versions: one tuple,
        # replaced whole, so that a lookup never pairs one array's row with another's.
        self._arrays = (np.zeros(0, "S1"), np.zeros(0, np.int64), np.zeros(0, "S1"))
        self._recent: dict[str, ObjectInfo] = {}

    def __len__(self) -> int:
        self._compact()
        return len(self._arrays[0])

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def get(self, key: str) -> ObjectInfo | None:
        found = self._recent.get(key)
        if found is not None:
            return found
        (keys, sizes, versions), raw = self._arrays, key.encode()
        i = int(np.searchsorted(keys, raw))
        if i < len(keys) and keys[i] == raw:
            return ObjectInfo(key, int(sizes[i]), versions[i].decode())
        return None

    def add(self, info: ObjectInfo) -> ObjectInfo:
        """Record `info` unless its key is known; the record kept."""
        known = self.get(info.key)
        if known is not None:
            return known
        self._recent[info.key] = info
        if len(self._recent) >= RECENT:
            self._compact()
        return info

    def update(self, infos: Iterable[ObjectInfo]) -> None:
        """Record every object whose key is not known yet (a whole listing at once)."""
        infos = list(infos)
        if infos:
            self._compact()  # keys seen before, by a read, are in _recent: they win
            self._merge(infos)

    def values(self) -> Iterator[ObjectInfo]:
        """Every object, sorted by key."""
        self._compact()
        keys, sizes, versions = self._arrays
        for key, size, version in zip(keys.tolist(), sizes.tolist(), versions.tolist(),
                                      strict=True):
            yield ObjectInfo(key.decode(), size, version.decode())

    def _compact(self) -> None:
        recent = list(self._recent.values())
        if recent:
            self._merge(recent)
            for o in recent:  # only now: a lookup meanwhile finds them in one or the other
                self._recent.pop(o.key, None)

    def _merge(self, infos: list[ObjectInfo]) -> None:
        old_keys, old_sizes, old_versions = self._arrays
        keys = np.concatenate([old_keys, np.array([o.key.encode() for o in infos], "S")])
        sizes = np.concatenate([old_sizes, np.array([o.size for o in infos], np.int64)])
        versions = np.concatenate([old_versions,
                                   np.array([o.version.encode() for o in infos], "S")])
        # The first occurrence of each key: what was known before wins.
        _, first = np.unique(keys, return_index=True)
        self._arrays = (keys[first], sizes[first], versions[first])
