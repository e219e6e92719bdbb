"""The server's one least-recently-used map: every cache of the server that drops its oldest
entries (shard bytes, footers, memory maps, scratch files, epoch orders, frame tables) keeps
them in an `LRU`, so that what "least recently used" means is written once.

An `LRU` bounds its entries by count (`max_items`), by the sum of `size(value)`
(`max_size`), or both. `put` returns what it evicted, so that its owner releases those
(closes a file, say) after letting go of its lock. Not thread-safe: each owner's lock guards
its LRU, as the owner's docstring says.

Why not cachetools: its LRUCache evicts one bound at a time and cannot spare an entry (the
disk cache's scratch files stay while a reader may still be opening one), and the owners
here need the evicted values back, which it hands only to a subclass's popitem.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _one(value: object) -> int:
    return 1


class LRU(Generic[K, V]):
    """Values by key, least recently used out first beyond `max_items` entries or a total
    `size` over `max_size` (None: no such bound). `get` is a use; `put` is a use of the key
    it puts, which that put never evicts."""

    def __init__(self, max_items: int | None = None, max_size: int | None = None,
                 size: Callable[[V], int] = _one) -> None:
        self.max_items = max_items
        self.max_size = max_size
        self._size_of = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self.size = 0  # the sum of size(value) over the entries

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def values(self) -> Iterator[V]:
        """The values, least recently used first; not a use."""
        return iter(list(self._items.values()))

    def get(self, key: K) -> V | None:
        """The value of `key` (a use), or None."""
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The value of `key` (a use), or `make()`'s, put under it."""
        found = self.get(key)
        if found is None:
            found = make()
            self.put(key, found)
        return found

    def pop(self, key: K) -> V | None:
        """Take `key` out (not an eviction: nothing is returned to release)."""
        found = self._items.pop(key, None)
        if found is not None:
            self.size -= self._size_of(found)
        return found

    def put(self, key: K, value: V, *, oldest: bool = False,
            spare: Callable[[V], bool] | None = None) -> list[tuple[K, V]]:
        """Keep `value` under `key` (replacing any value there, which is returned among the
        evicted), as the most recently used, or with `oldest` as the least; then evict the
        least recently used until within the bounds, skipping the new entry and any value
        `spare` says to keep (the map then stays over its bounds until a later put). Returns
        the evicted (key, value) pairs, oldest first."""
        evicted = []
        old = self._items.pop(key, None)
        if old is not None:
            self.size -= self._size_of(old)
            evicted.append((key, old))
        self._items[key] = value
        self.size += self._size_of(value)
        if oldest:
            self._items.move_to_end(key, last=False)
        evicted += self._trim(lambda k, v: k == key or (spare is not None and spare(v)))
        return evicted

    def resize(self, max_size: int | None) -> list[tuple[K, V]]:
        """A new `max_size`; returns what that evicted."""
        self.max_size = max_size
        return self._trim(lambda k, v: False)

    def _over(self, count: int, size: int) -> bool:
        return ((self.max_items is not None and count > self.max_items)
                or (self.max_size is not None and size > self.max_size))

    def _trim(self, kept: Callable[[K, V], bool]) -> list[tuple[K, V]]:
        count, size = len(self._items), self.size
        if not self._over(count, size):
            return []
        evicted = []
        for key, value in self._items.items():  # oldest first; deleted after the walk
            if not self._over(count, size):
                break
            if kept(key, value):
                continue
            evicted.append((key, value))
            count -= 1
            size -= self._size_of(value)
        for key, _ in evicted:
            del self._items[key]
        self.size = size
        return evicted
