"""A worker's shared-memory segments are reused, grown, and bounded (server/pool/shm.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stoker.server.pool import shm as _shm

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")]


def names(prefix: str) -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(prefix + "*")}


def test_segments_are_reused_grown_bounded_and_discarded() -> None:
    prefix = _shm.worker_prefix(os.getpid(), 999999)
    pool = _shm.SegmentPool(prefix, keep=2)
    try:
        a, mem = pool.acquire(100_000)
        assert len(mem) >= 100_000 and len(mem) % _shm.ROUND == 0
        mem[:5] = b"hello"
        pool.give_back(a)
        again, mem2 = pool.acquire(50_000)  # fits: the same segment, same pages
        assert again == a and mem2[:5] == b"hello"
        pool.give_back(a)
        grown, big = pool.acquire(1_000_000)  # nothing fits: the free one grows
        assert grown == a and len(big) >= 1_000_000 and big[:5] == b"hello"
        b, _ = pool.acquire(10)
        c, _ = pool.acquire(10)
        assert len({a, b, c}) == 3 and names(prefix) == {a, b, c}
        for name in (a, b, c):
            pool.give_back(name)
        assert names(prefix) == {a, b} or names(prefix) == {a, c}  # keep=2: a small one goes
        d, _ = pool.acquire(10)
        pool.discard(d)  # a failed batch's segment is not reused
        assert d not in names(prefix)
        pool.give_back("stoker_0_0_0")  # unknown names are ignored
    finally:
        assert _shm.remove_prefixed(prefix, set()) >= 1
    assert names(prefix) == set()


def test_the_front_ends_mappings_are_kept_remapped_when_grown_and_dropped_when_unlinked() -> None:
    prefix = _shm.worker_prefix(os.getpid(), 999998)
    pool = _shm.SegmentPool(prefix, keep=1)
    maps = _shm.ReadMappings()
    try:
        a, mem = pool.acquire(100)
        mem[:3] = b"abc"
        first = maps.get(a, 100)
        assert first[:3] == b"abc" and maps.get(a, 100) is first  # kept, not mapped again
        mem[:3] = b"xyz"
        assert first[:3] == b"xyz"  # shared: what the worker writes next is what is read
        pool.give_back(a)
        grown, _ = pool.acquire(10 * _shm.ROUND)  # the worker grows its segment
        assert grown == a
        again = maps.get(a, 10 * _shm.ROUND)
        assert again is not first and len(again) >= 10 * _shm.ROUND and first.closed
        b, _ = pool.acquire(10)
        maps.get(b, 10)
        pool.give_back(b)
        pool.give_back(a)  # keep=1: the smaller, b, is unlinked
        assert pool.acquire(10)[0] == a
        c, _ = pool.acquire(10)  # a new segment: mapping it sweeps the unlinked b
        maps.get(c, 10)
        assert b not in maps._maps and a in maps._maps and c in maps._maps
    finally:
        maps.close()
        _shm.remove_prefixed(prefix, set())
    assert names(prefix) == set()
