"""The reusable host-buffer pool behind the GPU feed, exercised on CPU with stand-in events."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from stoker.client import BufferPool


class CopyEvent:
    """Stands in for torch.cuda.Event: done when the test says the copy finished."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited = False

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waited = True
        assert self.done.wait(30), "copy never finished"


def pool(max_buffers: int = 2) -> BufferPool[np.ndarray]:
    return BufferPool(lambda n: np.empty(n, np.uint8), len, max_buffers)


def test_buffers_are_reused_not_reallocated() -> None:
    p = pool()
    a = p.acquire(1000)
    p.release(a)
    assert p.acquire(900) is a
    assert p.allocations == 1 and len(a) >= 1 << 20  # rounded up: small batches share sizes


def test_a_buffer_whose_copy_is_done_is_preferred() -> None:
    p = pool()
    a, b = p.acquire(10), p.acquire(10)
    busy, done = CopyEvent(), CopyEvent()
    done.done.set()
    p.release(a, busy)
    p.release(b, done)
    assert p.acquire(10) is b
    assert not busy.waited


def test_reuse_waits_for_the_copy_that_reads_the_buffer() -> None:
    p = pool(max_buffers=1)
    a = p.acquire(10)
    copy = CopyEvent()
    p.release(a, copy)
    threading.Timer(0.05, copy.done.set).start()
    assert p.acquire(10) is a
    assert copy.waited and copy.done.is_set()


def test_acquire_blocks_until_a_buffer_comes_back() -> None:
    p = pool(max_buffers=1)
    a = p.acquire(10)
    got: list[np.ndarray] = []
    t = threading.Thread(target=lambda: got.append(p.acquire(10)))
    t.start()
    t.join(0.1)
    assert t.is_alive() and not got  # all buffers are out: it waits
    p.release(a)
    t.join(30)
    assert got == [a]


def test_too_small_buffers_are_replaced_when_the_pool_is_full() -> None:
    p = pool(max_buffers=1)
    small = p.acquire(10)
    copy = CopyEvent()
    copy.done.set()
    p.release(small, copy)
    big = p.acquire(5 << 20)
    assert big is not small and len(big) >= 5 << 20 and p.allocations == 2


def test_max_buffers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_buffers"):
        pool(0)
