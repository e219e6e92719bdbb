"""A batch's samples fetched by several threads of a worker (pool/batch.py in_order): the
batch is the one a single thread builds, a failure is the one a single thread meets first,
and nothing fetched for the batch outlives it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from stoker.server.formats import DatasetParts
from stoker.server.formats.samples import SampleError
from stoker.server.pool import shm
from stoker.server.pool.batch import build_batch, in_order

pytestmark = pytest.mark.timeout(60)


class Slow:
    """Sample i: {"x": [i] * 4} after a sleep (which releases the GIL, as FFmpeg does); a
    sample in `bad` raises. Records how many fetches ran at once."""

    threaded_samples = True

    def __init__(self, n: int, bad: frozenset[int] = frozenset()) -> None:
        self.n, self.bad = n, bad
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.finished: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.002 * (1 + i % 3))  # out of step: later ones may finish first
            if i in self.bad:
                raise ValueError(f"bad sample {i}")
            return {"x": np.full(4, i, np.int64)}
        finally:
            with self.lock:
                self.running -= 1
                self.finished.append(i)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_in_order_gives_every_result_in_order(threads: int) -> None:
    ds = Slow(40)
    assert [int(s["x"][0]) for s in in_order(ds.__getitem__, list(range(40)), threads)] == (
        list(range(40)))
    assert ds.most <= threads
    if threads > 1:
        assert ds.most > 1  # it did fetch at once


def test_a_failure_comes_out_at_its_place_and_started_fetches_are_waited_for() -> None:
    ds = Slow(40, bad=frozenset({7, 9}))
    got = []
    with pytest.raises(ValueError, match="bad sample 7"):
        for s in in_order(ds.__getitem__, list(range(40)), 4):
            got.append(int(s["x"][0]))
    assert got == list(range(7))
    assert ds.running == 0  # nothing still running once the failure is out
    assert max(ds.finished) < 7 + 4 + 1  # at most `threads` ahead were started


def test_build_batch_with_threads_is_the_batch_one_thread_builds() -> None:
    pool = shm.SegmentPool(f"stoker_test_threads_{threading.get_ident()}_", 4)
    indices = np.array([5, 3, 17, 0, 11, 2, 29, 8], np.int64)
    try:
        payloads = []
        for threads in (1, 3):
            batch = build_batch(DatasetParts.of(Slow(30)), indices, pool, threads=threads)
            with open(f"/dev/shm/{batch.shm_name}", "rb") as f:
                payloads.append(f.read(batch.payload_bytes))
            pool.give_back(batch.shm_name)
        assert payloads[0] == payloads[1]
        with pytest.raises(SampleError, match="sample 17"):
            build_batch(DatasetParts.of(Slow(30, bad=frozenset({17, 29}))), indices, pool,
                        threads=3)
    finally:
        pool._release_free()

