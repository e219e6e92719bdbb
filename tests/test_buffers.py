"""The reusable host buffers: the pinned pool behind the GPU feed, exercised on CPU with
stand-in events, and the plain buffers that numpy and CPU torch output recycle."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from stoker.client import BufferPool, RemoteLoader
from stoker.client.delivery.buffers import HostBuffers


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


# -- HostBuffers: plain host buffers for numpy and CPU torch output --------------------------
def test_a_host_buffer_is_reused_only_when_nothing_refers_to_it() -> None:
    bufs = HostBuffers(max_buffers=3)
    a = bufs.acquire(1000)
    view = a[:10]  # a batch's array: a view keeps its buffer busy
    del a
    b = bufs.acquire(1000)
    assert not np.shares_memory(b, view)
    del view
    c = bufs.acquire(1000)  # a is free again: reused, not allocated
    assert bufs.allocations == 2 and not np.shares_memory(b, c)
    tensor = torch.from_numpy(c[:100])  # a tensor holds its buffer too
    del c
    d = bufs.acquire(1000)
    assert not np.shares_memory(d, tensor.numpy()) and bufs.allocations == 3
    big = bufs.acquire(1 << 20)  # every pooled buffer is busy: a fresh one, not kept
    assert big.nbytes >= 1 << 20 and bufs.allocations == 4


def test_a_free_buffer_that_is_too_small_is_replaced() -> None:
    bufs = HostBuffers(max_buffers=1)
    small = bufs.acquire(100)
    del small
    large = bufs.acquire(1 << 20)
    del large
    again = bufs.acquire(1 << 20)
    assert again.nbytes >= 1 << 20 and bufs.allocations == 2


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_kept_batches_stay_intact_and_dropped_ones_are_recycled(toy_server, output) -> None:
    loader = RemoteLoader(toy_server.address, "toy", batch_size=4, output=output, prefetch=2,
                          shared_memory=False)
    with loader:
        kept = list(loader)  # every batch held: nothing may be overwritten
        seen = np.concatenate([np.asarray(b["sample_index"]) for b in kept])
        assert len(seen) == len(set(seen.tolist())) == 100  # 103 samples, batches of 4
        for b in kept:
            np.testing.assert_array_equal(np.asarray(b["x"])[:, 0], np.asarray(b["sample_index"]))
        held = loader.stats()["host_allocations"]
        assert held >= len(kept)
        del kept, b
        for _ in loader:  # epoch 1, each batch dropped at once: the pool's few buffers
            pass
        assert loader.stats()["host_allocations"] - held <= 4
