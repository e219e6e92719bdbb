"""A worker's shared-memory segments are reused, grown, and bounded (server/_shm.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stoker.server import _shm

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
