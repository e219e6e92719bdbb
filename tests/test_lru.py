"""The server's one LRU (server/_lru.py), and the caches built on it: which entry goes, what
the owner is handed back to release, and what is spared."""

from __future__ import annotations

import os
import time

import numpy as np

from stoker.server._lru import LRU
from stoker.server.formats.memmap import OpenMaps
from stoker.server.order.sampling import OrderCache
from stoker.server.sources.cache import SCRATCH_GRACE, DiskCache


def test_the_least_recently_used_goes_first_and_a_get_is_a_use():
    lru: LRU[str, int] = LRU(max_items=2)
    assert lru.put("a", 1) == []
    assert lru.put("b", 2) == []
    assert lru.get("a") == 1  # now b is the oldest
    assert lru.put("c", 3) == [("b", 2)]
    assert "b" not in lru and lru.get("a") == 1 and lru.get("c") == 3
    assert len(lru) == 2


def test_a_size_bound_evicts_until_under_and_never_the_entry_just_put():
    lru: LRU[str, bytes] = LRU(max_size=10, size=len)
    lru.put("a", b"x" * 4)
    lru.put("b", b"x" * 4)
    assert lru.put("c", b"x" * 4) == [("a", b"x" * 4)]
    assert lru.size == 8
    # Larger than the bound alone: everything else goes, the new entry stays.
    assert [k for k, _ in lru.put("big", b"x" * 20)] == ["b", "c"]
    assert list(lru.values()) == [b"x" * 20] and lru.size == 20
    assert lru.resize(5) == [("big", b"x" * 20)] and lru.size == 0


def test_spared_values_stay_and_oldest_puts_at_the_old_end():
    lru: LRU[str, int] = LRU(max_items=2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.put("c", 3, spare=lambda v: v == 1) == [("b", 2)]  # a, the oldest, is spared
    assert lru.put("s", 0, spare=lambda v: True) == []  # all spared: over the bound for now
    assert len(lru) == 3
    assert lru.put("d", 4, oldest=True) == [("a", 1), ("c", 3)]  # d is kept, though oldest
    assert list(lru.values()) == [4, 0]
    assert lru.put("e", 5) == [("d", 4)]


def test_replacing_a_key_hands_back_the_old_value_and_pop_does_not_count_as_eviction():
    lru: LRU[str, bytes] = LRU(max_size=100, size=len)
    lru.put("a", b"old")
    assert lru.put("a", b"new!") == [("a", b"old")]
    assert lru.size == 4
    assert lru.pop("a") == b"new!" and lru.size == 0 and lru.pop("a") is None


def test_order_cache_keeps_by_bytes_and_does_not_keep_an_order_over_its_cap():
    cache: OrderCache[np.ndarray] = OrderCache(100)
    calls = []

    def order(n: int) -> np.ndarray:
        calls.append(n)
        return np.zeros(n, np.uint8)

    cache.get("a", lambda: order(60))
    cache.get("b", lambda: order(30))
    cache.get("a", lambda: order(60))  # a hit, and a use: b is now the oldest
    cache.get("c", lambda: order(30))  # 120 > 100: b goes, a stays
    assert cache.nbytes == 90
    cache.get("a", lambda: order(60))
    cache.get("b", lambda: order(30))
    assert calls == [60, 30, 30, 30]
    cache.get("huge", lambda: order(200))  # computed for its caller, not kept
    assert cache.nbytes <= 100
    cache.get("huge", lambda: order(200))
    assert calls[-2:] == [200, 200]


def test_open_maps_keeps_at_most_limit_open(tmp_path):
    from stoker.server.sources import open_storage

    for i in range(3):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * 8)
    storage = open_storage(str(tmp_path))
    opened = []

    def opener(key: str, path) -> np.ndarray:
        opened.append(key)
        return np.fromfile(path, np.uint8)

    maps = OpenMaps(storage, opener, limit=2)
    assert maps.get("0.bin")[0] == 0
    maps.get("1.bin")
    maps.get("0.bin")  # a use: 1.bin is now the oldest
    maps.get("2.bin")  # 1.bin is dropped
    maps.get("0.bin")
    assert opened == ["0.bin", "1.bin", "2.bin"]
    assert maps.get("1.bin")[0] == 1
    assert opened == ["0.bin", "1.bin", "2.bin", "1.bin"]


def test_scratch_files_close_on_eviction_but_not_within_their_grace(tmp_path, monkeypatch):
    """A read-only disk cache hands out memory files: beyond its bounds the oldest is closed,
    unless a reader may still be opening it (handed out under SCRATCH_GRACE ago)."""
    cache = DiskCache(tmp_path, max_bytes=1 << 20, scratch_bytes=10)
    cache.writable = False  # as once its disk is known read-only
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])

    def get(key: str):
        return cache.get(f"s3://b/{key}", "v1", lambda fd: os.write(fd, b"x" * 8))

    def is_open(path) -> bool:
        try:
            os.fstat(int(path.name))
            return True
        except OSError:
            return False

    a = get("a")
    b = get("b")  # over 10 bytes, but a is within its grace
    assert is_open(a) and is_open(b)
    assert get("a") == a  # a hit on the scratch file, and a use
    now[0] += SCRATCH_GRACE + 1
    c = get("c")  # a and b are past their grace: the oldest go until within the bounds
    assert not is_open(a) and not is_open(b) and is_open(c)
    assert get("c") == c
