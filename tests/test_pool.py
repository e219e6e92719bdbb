"""The worker pool on its own, against fake worker processes (tests/fake_workers.py): real
spawned children that speak the pool's messages but open no dataset and build nothing, so
that a test decides when each batch is done, which worker dies, and what data a worker sees.

What the pool promises here: the least busy worker takes the next task, none holds more than
the depth; each result goes to its own batch's waiter; a worker that dies fails the batch it
was on, its other tasks go to a new worker spawned in its place; a worker that sees other data
than worker 0 did is refused (at start: the start fails; a replacement: the pool shrinks and,
none left, batches fail UNAVAILABLE naming why).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_workers import DATASET, Script, main

from stoker.server._config import Config
from stoker.server._errors import StartError
from stoker.server.order.sampling import FIRST_EPOCH
from stoker.server.pool import shm
from stoker.server.pool.assign import Assignment
from stoker.server.pool.depth import SHALLOW_DEPTH
from stoker.server.pool.handle import Job, WorkerHandle
from stoker.server.pool.messages import Discard, FailureKind, GiveBack, Task
from stoker.server.pool.workers import BatchFailed, WorkerPool

pytestmark = pytest.mark.timeout(60)

WAIT = 20.0  # seconds for anything a test waits on


class Pools:
    """Makes pools of fake workers on `loop`, and closes them at the end of the test."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tmp_path: Path) -> None:
        ctx = mp.get_context("spawn")
        self.loop = loop
        self._events, events_w = ctx.Pipe(duplex=False)
        gate_r, self._gate_w = ctx.Pipe(duplex=False)
        self.drift = tmp_path / "drift"
        self._script = Script(events_w, gate_r, str(self.drift))
        self._config = Config.model_validate({
            "datasets": {DATASET: {"format": "python", "factory": "fake_workers:none"}},
            "cache": {"dir": str(tmp_path / "cache")}})
        self.made: list[WorkerPool] = []

    def make(self, workers: int) -> WorkerPool:
        """A pool of `workers` fake workers, not started."""
        pool = WorkerPool(self._config, workers, main=functools.partial(main, self._script))
        self.made.append(pool)
        return pool

    def start(self, workers: int) -> WorkerPool:
        pool = self.make(workers)
        pool.start(self.loop)
        return pool

    def open_gate(self) -> None:
        """From now on every worker builds what it holds, and every task as it comes."""
        self._gate_w.send_bytes(b"open")

    def submit(self, pool: WorkerPool, firsts: list[int]) -> list[concurrent.futures.Future]:
        """Submit batches of 4 samples from each of `firsts`, on the loop in one turn (as a
        stream's credit record is): they are handed out together, after it."""
        async def submit_all() -> list[concurrent.futures.Future]:
            return [pool.submit(DATASET, np.arange(f, f + 4)) for f in firsts]

        return asyncio.run_coroutine_threadsafe(submit_all(), self.loop).result(WAIT)

    def next(self, kind: str, n: int = 1, but: Callable[[tuple], bool] = bool) -> list[tuple]:
        """The next `n` events of `kind` the workers report (and `but` accepts)."""
        got: list[tuple] = []
        while len(got) < n:
            assert self._events.poll(WAIT), f"no {kind} event within {WAIT:g} s: {got}"
            event = self._events.recv()
            if event[0] == kind and but(event):
                got.append(event)
        return got

    def close(self) -> None:
        for pool in self.made:
            pool.close()


@pytest.fixture
def pools(tmp_path: Path) -> Iterator[Pools]:
    loop = asyncio.new_event_loop()  # the server's loop: the pool reads results on it
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    made = Pools(loop, tmp_path)
    try:
        yield made
    finally:
        made.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def builder(batch: Any) -> int | None:
    """The pid of the worker that built `batch`."""
    return shm.worker_of(batch.shm_name)


def test_tasks_go_to_the_least_busy_worker_up_to_the_depth_and_results_to_their_waiters(
        pools: Pools) -> None:
    pool = pools.start(2)
    assert pool.depth == SHALLOW_DEPTH == 2  # before any batch is built
    firsts = [0, 10, 20, 30, 40]
    futures = pools.submit(pool, firsts)
    got = pools.next("task", 4)  # the workers hold them: none is built yet
    by_worker: dict[int, list[int]] = {}
    for _, pid, task_id, _first in got:
        by_worker.setdefault(pid, []).append(task_id)
    # Turn about (the least busy first), two each (the depth); the fifth waits for room.
    assert sorted(by_worker.values()) == [[1, 3], [2, 4]], got
    assert pool.status() == {"workers": 2, "queued": 1, "building": 4, "held": 0,
                             "timeouts": 0, "cache_hits": 0, "cache_misses": 0,
                             "cache_fetched_bytes": 0}
    pools.open_gate()  # each worker sends its results newest first
    batches = [f.result(WAIT) for f in futures]
    for first, batch in zip(firsts, batches, strict=True):
        assert batch.shm_name.endswith(f"x{first}") and batch.num_samples == 4, batch
    assert {builder(b) for b in batches[:4]} == set(by_worker)
    odd = next(pid for pid, ids in by_worker.items() if ids == [1, 3])
    assert builder(batches[0]) == builder(batches[2]) == odd
    assert pool.status()["building"] == 0 and pool.status()["held"] == 5
    for batch in batches:
        pool.release(batch)
    assert pool.status()["held"] == 0


def test_a_worker_that_dies_fails_its_batch_and_a_new_one_builds_the_others(
        pools: Pools) -> None:
    pool = pools.start(1)
    first, second = pools.submit(pool, [0, 10])
    (_, pid, _, _), _ = pools.next("task", 2)  # both on the one worker, the first building
    os.kill(pid, signal.SIGKILL)
    failed = first.exception(WAIT)
    assert isinstance(failed, BatchFailed) and failed.kind is FailureKind.INTERNAL, failed
    assert "worker process died (exit code -9) while building it" in str(failed)
    [(_, new, probe)] = pools.next("opened", but=lambda e: e[1] != pid)
    assert not probe  # only worker 0 describes the datasets, at start
    pools.open_gate()
    assert builder(second.result(WAIT)) == new  # given to the new worker, not lost
    [third] = pools.submit(pool, [20])
    assert builder(third.result(WAIT)) == new
    assert pool.status()["workers"] == 1


def test_a_replacement_that_sees_other_data_is_refused_and_batches_then_fail_naming_why(
        pools: Pools) -> None:
    pool = pools.start(1)
    first, second = pools.submit(pool, [0, 10])
    (_, pid, _, _), _ = pools.next("task", 2)
    pools.drift.touch()  # the data changes: a worker that opens it now sees more samples
    os.kill(pid, signal.SIGKILL)
    assert isinstance(first.exception(WAIT), BatchFailed)
    pools.next("opened", but=lambda e: e[1] != pid)  # its replacement, which sees the change
    pools.open_gate()  # a worker that serves would build the second batch now
    refused = second.exception(WAIT)
    assert isinstance(refused, BatchFailed) and refused.kind is FailureKind.UNAVAILABLE, refused
    said = str(refused)
    assert "sees other data than the server opened" in said, said
    assert "48 objects" in said and "restart the server" in said, said
    with pytest.raises(BatchFailed) as later:
        pool.submit(DATASET, np.arange(4))
    assert later.value.kind is FailureKind.UNAVAILABLE and str(later.value) == said
    assert pool.status()["workers"] == 0


def test_a_worker_that_sees_other_data_at_start_fails_the_start(pools: Pools) -> None:
    pools.drift.touch()  # worker 1 sees other data than worker 0 (which probes)
    pool = pools.make(2)
    with pytest.raises(StartError, match="the data changed while the server started"):
        pool.start(pools.loop)


def _handles(n: int) -> list[WorkerHandle]:
    """Workers as the bookkeeping sees them: no process, no pipe."""
    nothing: Any = None
    return [WorkerHandle(process=nothing, conn=nothing, ready=True) for _ in range(n)]


def test_segments_given_back_go_before_the_tasks_and_a_cancelled_batch_is_not_sent() -> None:
    jobs = Assignment(threading.Lock(), batch_timeout=60.0)
    a, b = _handles(2)
    a.freed, b.dropped = ["s1"], ["s2"]
    with jobs.lock:
        futures = [jobs.add_locked(DATASET, np.arange(i, i + 4), np.arange(0), FIRST_EPOCH)
                   for i in (0, 10, 20)]
        futures[0].cancel()  # its stream has gone
        out = dict((id(w), m) for w, m in jobs.deal_locked([a, b], flush=False))
    assert [type(m) for m in out[id(a)]] == [GiveBack, Task]
    assert out[id(a)][0] == GiveBack(["s1"]) and out[id(a)][1].task_id == 2
    assert [type(m) for m in out[id(b)]] == [Discard, Task] and out[id(b)][1].task_id == 3
    assert a.freed == [] and b.dropped == [] and not jobs.queue
    assert [isinstance(j, Job) for j in a.jobs.values()] == [True]
