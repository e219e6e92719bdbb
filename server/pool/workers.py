"""A pool of worker processes that build batches into shared memory: the one object the front
end holds (WorkerPool), in front of its parts:

    lifecycle.py   the workers' lives: spawn, open, refuse other data, replace, remove
    assign.py      which worker builds which batch: the queue, depth, futures
    loop_side.py   the event loop's share: it reads ready workers' results and hands out the
                   tasks submitted on it
    dispatch.py    the dispatcher thread: it watches the workers' lives, and hands out what
                   is submitted off the loop
    parts.py       batches cut into parts that several workers build at once, into one
                   segment of the pool's own

Tasks and results travel as small messages (pool/messages.py) over one pipe per worker; batch
payloads travel in shared memory (see pool/batch.py), never through the pipe.

Threading contract: submit(), release() and status() may be called from any thread; start()
and close() from the owner's, before the dispatcher thread starts and after it stops (start()
is given the event loop that submits batches, and may run on another thread). One lock, the
pool's, guards what the threads share (each part's module doc says what); no pipe is read,
and no process started or joined, while holding it. Tasks are sent under _send_lock, by
whichever thread hands them out (the loop's or the dispatcher's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Hashable
from typing import Any

import numpy as np

from ..order.sampling import FIRST_EPOCH, EpochKey
from ..sources import prefix_cache
from . import shm
from .assign import Assignment, fail_all
from .dispatch import Dispatcher
from .handle import send
from .layout import BuiltBatch
from .lifecycle import WorkerMain, Workers
from .loop_side import LoopSide
from .messages import BatchFailed, DatasetMeta, FailureKind, Stop
from .parts import OwnSegments, Plan, Splitter
from .worker_main import worker_main

__all__ = ["BatchFailed", "DatasetMeta", "FailureKind", "WorkerMain", "WorkerPool"]

log = logging.getLogger("stoker.server")

_NOTHING = np.zeros(0, np.int64)


class WorkerPool:
    """Worker processes and the queue of batches waiting for one. `main`: what each worker
    process runs (tests give a fake that speaks pool/messages.py)."""

    def __init__(self, config: Any, processes: int, main: WorkerMain = worker_main) -> None:
        self._config = config
        ctx = mp.get_context("spawn")
        self._jobs = Assignment(threading.Lock(), float(config.server.batch_timeout_seconds))
        self._lock = self._jobs.lock
        self._send_lock = threading.Lock()  # held while tasks are handed out and sent
        self._loop_side = LoopSide(self._assign)
        self._workers = Workers(config, processes, ctx, self._jobs, self._loop_side,
                                self.release, main)
        self._dispatcher = Dispatcher(ctx, self._workers, self._jobs, self._assign)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> dict[str, DatasetMeta]:
        """Start the workers and wait until each has opened every dataset. `loop`: the event
        loop that submits batches, which then reads the workers' results (see loop_side.py);
        start() itself may run on another thread.

        Raises StartError; call close() in any case, to stop those that did start."""
        orphans = shm.sweep()
        prefix_cache.sweep(self._config.cache)  # issue 17: caches of servers that died
        if orphans:
            log.warning("removed %d shared-memory segments left by servers that died", orphans)
        self._loop_side.attach(loop)
        meta = self._workers.open()
        with self._lock:
            self._jobs.splitter = Splitter({n: m.fields for n, m in meta.items()},
                                           int(self._config.server.max_batch_bytes))
            self._jobs.segments = OwnSegments(len(self._workers.workers))
        self._dispatcher.start()
        return meta

    def opened(self, dataset: str, meta: DatasetMeta) -> None:
        """A dataset the workers open on its first batch (a lake table's snapshot, which the
        front end has opened for its meta): its batches may be cut into parts too."""
        with self._lock:
            if self._jobs.splitter is not None:
                self._jobs.splitter.add_locked(dataset, meta.fields)

    @property
    def meta(self) -> dict[str, DatasetMeta]:
        """Each dataset as worker 0 opened it (empty before start())."""
        return self._workers.meta

    def close(self) -> None:
        """Stop the workers; fail what is still queued; free what they built."""
        with self._lock:
            self._jobs.closing = True
        self._dispatcher.stop()
        with self._lock:
            workers = list(self._workers.workers)
        for w in workers:
            self._loop_side.take_back(w)
        with self._send_lock:  # not amid a send of the loop's (its flush timer may fire)
            for w in workers:
                send(w, Stop())
        for w in workers:
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            self._workers.drain(w)
            with self._lock:
                jobs = list(w.jobs.values())
            fail_all(jobs, "server shutting down")
            w.conn.close()
        with self._lock:
            for job in self._jobs.clear_locked():
                job.future.cancel()
        # Whatever a stream or a worker still held: nothing of ours outlives the server.
        shm.sweep(os.getpid())
        prefix_cache.remove(self._config.cache, os.getpid())

    # -- the front end's calls -------------------------------------------------------------
    def submit(self, dataset: str, indices: np.ndarray, ahead: np.ndarray = _NOTHING,
               key: EpochKey = FIRST_EPOCH, sources: bool = False, lane: Hashable = None
               ) -> concurrent.futures.Future[BuiltBatch]:
        """Build the batch of `indices` for the epoch `key`; `ahead`: samples a later batch
        will need (a hint). `sources`: instead, where each sample comes from (Task.sources:
        one worker, never in parts). `lane`: who asks (batches queue fairly between lanes,
        each lane's in the order they came: fair_queue.py)."""
        with self._lock:
            self._check_locked()
            plan = None if sources else self._jobs.splitter.plan_locked(
                dataset, len(indices), self._workers_locked)
            if plan is None:
                fut = self._jobs.add_locked(dataset, indices, ahead, key, sources, lane)
                inline, wake = self._hand_out_locked()
        if plan is not None:
            fut, inline, wake = self._submit_parts(dataset, indices, ahead, key, plan, lane)
        if inline:
            self._loop_side.assign_soon()
        if wake:
            self._dispatcher.write_wake()
        return fut

    def _submit_parts(self, dataset: str, indices: np.ndarray, ahead: np.ndarray,
                      key: EpochKey, plan: Plan, lane: Hashable
                      ) -> tuple[concurrent.futures.Future[BuiltBatch], bool, bool]:
        """submit() of a batch cut into parts, built into a segment of the pool's (taken
        outside the pool's lock: a new one is made and its pages reserved)."""
        segments = self._jobs.segments
        assert segments is not None
        try:
            segment: str | None = segments.acquire(plan.size)
        except shm.ShmFull:  # a worker's own build meets it too, and says so as ever
            segment = None
        with self._lock:
            try:
                self._check_locked()
            except BaseException:  # closing, no worker left, the dispatcher broke
                if segment is not None:
                    segments.give_back(segment)
                raise
            fut = (self._jobs.add_locked(dataset, indices, ahead, key, lane=lane)
                   if segment is None
                   else self._jobs.add_parts_locked(dataset, indices, ahead, key, plan,
                                                    segment, lane))
            return (fut, *self._hand_out_locked())

    def _workers_locked(self) -> tuple[int, int]:
        """(Workers that would otherwise have nothing to build: those idle, less the jobs
        queued; workers ready), which a batch is cut over (parts.workers_for)."""
        workers = self._workers.workers
        idle = sum(w.ready and not w.jobs for w in workers)
        return idle - len(self._jobs.queue), sum(w.ready for w in workers)

    def _hand_out_locked(self) -> tuple[bool, bool]:
        """After a submit: (whether this thread hands out, on the loop; whether it wakes the
        dispatcher to)."""
        inline = self._loop_side.on_loop_thread()
        return inline, not inline and self._dispatcher.wake_locked()

    def _check_locked(self) -> None:
        """Raise BatchFailed if no batch can be built now."""
        if self._jobs.closing:
            raise BatchFailed(FailureKind.INTERNAL, "server shutting down")
        if not self._workers.workers and self._workers.refusal is not None:
            raise BatchFailed(FailureKind.UNAVAILABLE, self._workers.refusal)
        if not self._workers.workers:
            raise BatchFailed(FailureKind.INTERNAL, "no worker process is running")
        if self._jobs.broken:
            raise BatchFailed(FailureKind.INTERNAL,
                              "the server's worker dispatcher failed (see its log)")

    def release(self, batch: BuiltBatch, reuse: bool = True) -> None:
        """The front end is done with a built batch (sent, or nobody wants it): its segment
        goes back to the worker that made it (the pool's own, for a batch built in parts),
        or is unlinked if that worker is gone. reuse=False: unlinked in any case (a client
        may still be reading it: its mapping stays valid, and no worker will write into it
        again). Any thread."""
        name = batch.shm_name
        segments = self._jobs.segments
        if segments is not None and segments.owns(name):
            with self._lock:
                self._jobs.lent.discard(name)
            (segments.give_back if reuse else segments.discard)(name)
            return
        wake = inline = False
        with self._lock:
            self._jobs.lent.discard(name)
            w = (None if self._jobs.closing
                 else self._workers.by_pid.get(shm.worker_of(name) or -1))
            if w is not None:
                (w.freed if reuse else w.dropped).append(name)
                inline = self._loop_side.on_loop_thread()
                wake = not inline and self._dispatcher.wake_locked()
        if w is None or not reuse:
            shm.unlink(name)
        if inline:
            self._loop_side.flush_later()
        if wake:
            self._dispatcher.write_wake()

    def status(self) -> dict[str, int]:
        """Workers ready (a worker past its batch's deadline is not), batches queued for a
        worker, batches handed to workers, built batches the front end holds (being sent, or
        kept for other jobs: their segments are not back with their workers), workers
        replaced for a batch past its deadline, and the disk cache's counters. Any thread."""
        now = time.monotonic()
        with self._lock:
            workers = self._workers.workers
            up = sum(w.ready and not self._jobs.overdue_locked(w, now) for w in workers)
            return {"workers": up if not self._jobs.broken else 0,
                    "queued": len(self._jobs.queue),
                    "building": sum(len(w.jobs) for w in workers),
                    "held": len(self._jobs.lent),
                    "timeouts": self._dispatcher.timeouts,
                    **dict(zip(("cache_hits", "cache_misses", "cache_fetched_bytes"),
                               self._workers.cache_counts(), strict=True))}

    def pids(self) -> list[int]:
        """The worker processes' pids (for their memory in /v1/stats). Any thread."""
        with self._lock:
            return [w.process.pid for w in self._workers.workers if w.process.pid]

    def capacity(self) -> tuple[int, float]:
        """(workers ready, the pool's measured build rate in samples/s: the workers over a
        worker's running mean time per sample; 0.0 before the first batch). Any thread."""
        with self._lock:
            workers = sum(w.ready for w in self._workers.workers)
            per_sample = self._jobs.splitter.per_sample
        return workers, (workers / per_sample if per_sample > 0 else 0.0)

    @property
    def depth(self) -> int:
        """Tasks each worker holds at most now (DEPTH or SHALLOW_DEPTH, by the batches'
        size)."""
        return self._jobs.depth

    # -- handing out -----------------------------------------------------------------------
    def _assign(self, flush: bool = True) -> None:
        """Send each worker, in one pipe message, the segments given back and the tasks it
        has room for: a pipe write (and a wake-up of the worker) per round, not one per
        message (in steady state a freed segment and a task per batch: half the writes).
        The dispatcher's, or the loop's: one at a time. `flush`: the segments given back go
        to every worker that has some; else only with a task (the loop's, per batch: the
        rest within loop_side.GIVE_BACK_WAIT)."""
        with self._send_lock:
            with self._lock:
                out = self._jobs.deal_locked(self._workers.workers, flush)
            for w, messages in out:
                if messages:
                    send(w, messages[0] if len(messages) == 1 else tuple(messages))
