"""A pool of worker processes that build batches into shared memory.

Workers are spawned (not forked): the front end runs gRPC threads, which do not survive fork.
Each worker opens every configured dataset itself (see pool/worker_main.py); the front end never
imports user code. Tasks and results travel as small messages (pool/messages.py) over one pipe per
worker; batch payloads travel in shared memory (see pool/batch.py), never through the pipe.

Threading contract: submit(), release() and status() may be called from any thread; start()
and close() from the owner's, before the dispatcher thread starts and after it stops. In
between, the dispatcher thread is the only one that changes the worker list: it starts
workers, and replaces those that die, or that hang: a batch not built within
batch_timeout_seconds fails (INTERNAL, naming the worker and the sample it was at; clients
retry it) and its worker is killed and replaced.

Batches flow on the server's event loop when start() is given it (the server does): the loop
reads each ready worker's results (loop.add_reader), resolves their futures and hands out the
next tasks itself, in the thread that submits them; the dispatcher thread then only watches
the workers' lives. A batch so crosses no thread: no wake-up pipe, no hop back to the loop
(at 64 KiB batches the dispatcher thread's hops cost about a third of the front end's time
per batch, and each one contended for the GIL with the loop). A worker's pipe is read by one
thread at a time: the dispatcher's until the worker is ready, the loop's from then on, and the
dispatcher's again once it takes the pipe back (_unwatch) to replace or stop the worker.
Without a loop, the dispatcher does it all. Tasks are sent under _send_lock, by whichever
thread hands them out. WorkerPool._lock guards what the threads share (see WorkerPool); no
pipe is read, and no process started or joined, while holding it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import select
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import StartError
from ..order.fingerprint import Fingerprint
from ..order.sampling import FIRST_EPOCH, EpochKey
from . import prefix_cache, shm
from .depth import SHALLOW_DEPTH, depth_for
from .layout import BuiltBatch
from .messages import (
    BuildFailed,
    Built,
    DatasetMeta,
    Discard,
    FailureKind,
    FromWorker,
    GiveBack,
    Opened,
    OpenFailed,
    Stop,
    Task,
    ToWorker,
)
from .worker_main import worker_main

__all__ = ["BatchFailed", "DatasetMeta", "FailureKind", "WorkerPool"]

log = logging.getLogger("stoker.server")


class BatchFailed(Exception):
    """A batch could not be built; `kind` says why (the front end maps it to a gRPC status).
    The message is what the client is told; `detail`, what the server's log says."""

    def __init__(self, kind: FailureKind, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.detail = detail or message


@dataclass(frozen=True)
class _Job:
    task: Task  # what the worker is sent
    future: concurrent.futures.Future[BuiltBatch]  # who waits for the batch


@dataclass
class _Worker:
    """One worker process and the pool's bookkeeping of it; the fields after `conn` are
    guarded by WorkerPool._lock."""

    process: Any
    conn: mpc.Connection
    ready: bool = False
    # Segments the front end has finished with, to send back on the next dispatcher round.
    freed: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # unlinked: the worker forgets them
    # Tasks sent to this worker by id, oldest first: the first is the one it is building.
    jobs: dict[int, _Job] = field(default_factory=dict)
    head_since: float = 0.0  # monotonic time the first of `jobs` started
    # Shared int64 [task id, sample] the worker writes as it goes (read without the lock).
    progress: Any = None
    # Its pipe is read by the event loop (set by the dispatcher before the loop's first read,
    # cleared by _unwatch after its last); `poller` polls the pipe without a new selector.
    on_loop: bool = False
    poller: Any = None


# Seconds the dispatcher sleeps at most while the loop hands out tasks (it then learns of a
# batch's deadline only by looking): how late, at most, a hung worker is found.
LOOK_EVERY = 0.25
# Seconds a segment given back waits for the next task to ride along with to its worker,
# before it goes alone (the end of an epoch): one pipe write per batch instead of two.
GIVE_BACK_WAIT = 0.02
# Seconds the dispatcher waits for the loop to let go of a worker's pipe (see _unwatch).
UNWATCH_WAIT = 5.0

_NOTHING = np.zeros(0, np.int64)


class WorkerPool:
    """Worker processes and the queue of batches waiting for one.

    _lock guards the queue, the worker list and each worker's bookkeeping (see _Worker),
    _by_pid, _lent, _next_id and the flags; the dispatcher thread, the only one that changes
    the worker list, may read the list without it."""

    def __init__(self, config: Any, processes: int) -> None:
        self._config = config
        self._n = processes
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._queue: collections.deque[_Job] = collections.deque()
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        # A wake-up is in the pipe and the dispatcher has not taken it yet: submit() and
        # release() then write none (one pipe write, not one per batch; see _wake).
        self._woken = False
        self._next_id = 0
        self._closing = False
        self._broken = False  # the dispatcher thread died of a bug
        self._thread: threading.Thread | None = None
        self._by_pid: dict[int, _Worker] = {}
        self._lent: set[str] = set()  # segments of built batches the front end holds
        self.meta: dict[str, DatasetMeta] = {}
        # Why the last replacement worker was refused (its data differs): what batches
        # fail with once no worker is left.
        self._refusal: str | None = None
        # A batch a worker has been on longer than this: the worker hangs (see _expire).
        self._batch_timeout = float(config.server.batch_timeout_seconds)
        self._timeouts = 0  # workers replaced for it
        self._loop: asyncio.AbstractEventLoop | None = None  # batches flow on it (module doc)
        self._send_lock = threading.Lock()  # held while tasks are handed out and sent
        self._give_back: asyncio.TimerHandle | None = None  # the loop's _assign, pending
        self._assign_soon = False  # _assign_submitted is scheduled on the loop
        # Tasks per worker, by the size of the latest batch built (see depth.DEPTH).
        self._depth = SHALLOW_DEPTH
        # ISSUE 31 STOPGAP (lead: merge with the parallel-parts pool's own capacity): a
        # worker's seconds per sample, moving average of built batches (0.0: none yet).
        self._sample_seconds = 0.0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> dict[str, DatasetMeta]:
        """Start the workers and wait until each has opened every dataset. `loop`: the event
        loop that submits batches, which then reads the workers' results (see the module
        doc); start() itself may run on another thread.

        Raises StartError; call close() in any case, to stop those that did start."""
        orphans = shm.sweep()
        prefix_cache.sweep(self._config.cache)  # issue 17: caches of servers that died
        if orphans:
            log.warning("removed %d shared-memory segments left by servers that died", orphans)
        for i in range(self._n):
            w = self._spawn(probe=i == 0, slot=i)
            with self._lock:
                self._workers.append(w)
        for i, w in enumerate(list(self._workers)):
            try:
                message = w.conn.recv()
            except EOFError:
                w.process.join()
                raise StartError(f"worker process exited with code "
                                       f"{w.process.exitcode} while starting") from None
            match message:
                case OpenFailed(reason):
                    raise StartError(reason)
                case Opened(meta, prints):
                    if meta is not None:  # the probing worker: the first
                        self.meta = meta
                    for name, seen in self._differing(prints):
                        views = _views("worker 0", self.meta[name].fingerprint, f"worker {i}",
                                       seen)
                        raise StartError(f"dataset {name!r}: the data changed while the server "
                                         f"started: {views}. Start again once it is settled")
                    with self._lock:
                        w.ready = True
                case _:
                    raise StartError(f"a starting worker sent {message!r}")
        if loop is not None:
            self._loop = loop
            for w in self._workers:
                self._hand_to_loop(w)
        self._thread = threading.Thread(target=self._dispatch, name="stoker-dispatch", daemon=True)
        self._thread.start()
        return self.meta

    def close(self) -> None:
        """Stop the workers; fail what is still queued; free what they built."""
        with self._lock:
            self._closing = True
        self._wake_w.send_bytes(b"x")
        if self._thread:
            self._thread.join(timeout=30)
        with self._lock:
            workers = list(self._workers)
        for w in workers:
            self._unwatch(w)
        with self._send_lock:  # not amid a send of the loop's (its flush timer may fire)
            for w in workers:
                _send(w, Stop())
        for w in workers:
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            self._drain(w)
            with self._lock:
                jobs = list(w.jobs.values())
            self._fail_all(jobs, "server shutting down")
            w.conn.close()
        with self._lock:
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
        # Whatever a stream or a worker still held: nothing of ours outlives the server.
        shm.sweep(os.getpid())
        prefix_cache.remove(self._config.cache, os.getpid())

    def release(self, batch: BuiltBatch, reuse: bool = True) -> None:
        """The front end is done with a built batch (sent, or nobody wants it): its segment
        goes back to the worker that made it, or is unlinked if that worker is gone.
        reuse=False: unlinked in any case (a client may still be reading it: its mapping
        stays valid, and the worker will not write into it again). Any thread."""
        name = batch.shm_name
        wake = inline = False
        with self._lock:
            self._lent.discard(name)
            w = None if self._closing else self._by_pid.get(shm.worker_of(name) or -1)
            if w is not None:
                (w.freed if reuse else w.dropped).append(name)
                inline = self._on_loop_thread()
                wake = not inline and self._wake()
        if w is None or not reuse:
            shm.unlink(name)
        if inline and self._give_back is None:
            # Sent with the next task (a batch's credit is usually on its way), or alone
            # once GIVE_BACK_WAIT passes without one.
            assert self._loop is not None
            self._give_back = self._loop.call_later(GIVE_BACK_WAIT, self._flush)
        if wake:
            self._wake_w.send_bytes(b"x")

    def status(self) -> dict[str, int]:
        """Workers ready (a worker past its batch's deadline is not), batches queued for a
        worker, batches handed to workers, built batches the front end holds (being sent, or
        kept for other jobs: their segments are not back with their workers), workers
        replaced for a batch past its deadline. Any thread."""
        now = time.monotonic()
        with self._lock:
            up = sum(w.ready and not self._overdue(w, now) for w in self._workers)
            return {"workers": up if not self._broken else 0,
                    "queued": len(self._queue),
                    "building": sum(len(w.jobs) for w in self._workers),
                    "held": len(self._lent),
                    "timeouts": self._timeouts}

    def capacity(self) -> tuple[int, float]:
        """(workers ready, samples/s they build together: 0.0 until a batch was built).
        Any thread. ISSUE 31 STOPGAP: one worker builds a whole batch here, so the rate is
        the workers over a worker's measured seconds per sample."""
        workers = self.status()["workers"]
        with self._lock:
            per_sample = self._sample_seconds
        return workers, workers / per_sample if per_sample else 0.0

    def _overdue(self, w: _Worker, now: float) -> bool:
        """Whether `w` is past its batch's deadline (under the lock)."""
        return bool(w.jobs) and now - w.head_since > self._batch_timeout

    # -- submitting ------------------------------------------------------------------------
    def submit(self, dataset: str, indices: np.ndarray, ahead: np.ndarray = _NOTHING,
               key: EpochKey = FIRST_EPOCH) -> concurrent.futures.Future[BuiltBatch]:
        """Build the batch of `indices` for the epoch `key`; `ahead`: samples a later batch
        will need (a hint)."""
        fut: concurrent.futures.Future[BuiltBatch] = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                raise BatchFailed(FailureKind.INTERNAL, "server shutting down")
            if not self._workers and self._refusal is not None:
                raise BatchFailed(FailureKind.UNAVAILABLE, self._refusal)
            if not self._workers:
                raise BatchFailed(FailureKind.INTERNAL, "no worker process is running")
            if self._broken:
                raise BatchFailed(FailureKind.INTERNAL,
                                  "the server's worker dispatcher failed (see its log)")
            self._next_id += 1
            self._queue.append(_Job(Task(self._next_id, dataset, indices, ahead, key), fut))
            inline = self._on_loop_thread()
            wake = not inline and self._wake()
        if inline and not self._assign_soon:
            # Handed out once this turn of the loop is over: the batches of a credit record,
            # submitted in the same turn, go in one pipe write per worker.
            self._assign_soon = True
            assert self._loop is not None
            self._loop.call_soon(self._assign_submitted)
        if wake:
            self._wake_w.send_bytes(b"x")
        return fut

    def _assign_submitted(self) -> None:
        self._assign_soon = False
        self._assign(flush=False)

    @property
    def depth(self) -> int:
        """Tasks each worker holds at most now (DEPTH or SHALLOW_DEPTH, by the batches'
        size)."""
        return self._depth

    def _on_loop_thread(self) -> bool:
        """Whether the caller runs on the loop batches flow on: it hands out tasks itself."""
        if self._loop is None:
            return False
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    # -- the loop's side (see the module doc) ------------------------------------------------
    def _hand_to_loop(self, w: _Worker) -> None:
        """A ready worker's pipe goes to the loop (from the thread that read it so far, which
        reads it no more: the dispatcher leaves it out of its next wait)."""
        assert self._loop is not None
        w.poller = select.poll()
        w.poller.register(w.conn.fileno(), select.POLLIN)
        w.on_loop = True
        try:
            self._loop.call_soon_threadsafe(self._watch, w)
        except RuntimeError:  # the loop has closed: nobody submits any more
            w.on_loop = False

    def _watch(self, w: _Worker) -> None:
        """On the loop: read `w`'s results as they come (unless it was taken back since)."""
        if w.on_loop:
            assert self._loop is not None
            self._loop.add_reader(w.conn.fileno(), self._on_readable, w)

    def _on_readable(self, w: _Worker) -> None:
        """On the loop: settle what `w` has sent, then hand out tasks (it has room now)."""
        got = False
        try:
            while w.poller.poll(0):
                self._settle_all(w, w.conn.recv())
                got = True
        except (EOFError, OSError):  # it died: the dispatcher's wait sees its sentinel
            self._stop_reading(w)
        if got:
            self._assign(flush=False)

    def _stop_reading(self, w: _Worker) -> None:
        assert self._loop is not None
        with contextlib.suppress(ValueError, OSError, RuntimeError):  # closed pipe, or loop
            self._loop.remove_reader(w.conn.fileno())

    def _unwatch(self, w: _Worker) -> None:
        """Take `w`'s pipe back from the loop (any thread but the loop's waits until the loop
        has let go of it); the caller may read it from then on."""
        if not w.on_loop:
            return
        assert self._loop is not None

        def let_go() -> None:
            w.on_loop = False
            self._stop_reading(w)

        if self._on_loop_thread():
            let_go()
            return
        done = threading.Event()

        def on_loop() -> None:
            try:
                let_go()
            finally:
                done.set()

        try:
            self._loop.call_soon_threadsafe(on_loop)
        except RuntimeError:  # the loop has closed: it reads nothing any more
            w.on_loop = False
            return
        if not done.wait(UNWATCH_WAIT):  # the loop is stopped, or stuck: it reads nothing
            log.warning("the event loop did not let go of worker pid %s's pipe within %.0f s",
                        w.process.pid, UNWATCH_WAIT)
            w.on_loop = False

    def _wake(self) -> bool:
        """Whether the caller, having queued work under the lock, must write a wake-up:
        not if one is already in the pipe. The dispatcher clears the flag under the lock
        before it looks at the work, so what was queued before is seen then, and what comes
        after writes again. Saves a pipe write (and a dispatcher round) per batch when
        credits and releases come faster than the dispatcher turns."""
        woken, self._woken = self._woken, True
        return not woken

    # -- the dispatcher thread -------------------------------------------------------------
    def _spawn(self, probe: bool, slot: int) -> _Worker:
        """Start a worker; `slot`: its place in the pool (a replacement takes the one of the
        worker it replaces), which names it in `ps`."""
        parent, child = self._ctx.Pipe()
        progress = self._ctx.RawArray("q", [0, -1])
        p = self._ctx.Process(target=worker_main,
                              args=(self._config, child, probe, log.getEffectiveLevel(),
                                    progress, slot),
                              name="stoker-worker", daemon=True)
        p.start()
        child.close()
        w = _Worker(p, parent, progress=progress)
        with self._lock:
            self._by_pid[p.pid] = w
        return w

    def _dispatch(self) -> None:
        try:
            self._dispatch_loop()
        except Exception:  # a bug: say so, and fail every batch instead of stalling them
            log.exception("the worker dispatcher failed; this server can build no batch")
            with self._lock:
                self._broken = True
                jobs = list(self._queue)
                self._queue.clear()
                for w in self._workers:
                    jobs += w.jobs.values()
            self._fail_all(jobs, "the server's worker dispatcher failed (see its log)")

    def _dispatch_loop(self) -> None:
        # One selector for as long as the workers stay the same (mpc.wait makes and fills a
        # new one per call: about a fifth of this thread's time per batch at 64 KiB).
        selector: selectors.BaseSelector | None = None
        watched: tuple[tuple[int, int], ...] = ()
        owner: dict[Any, _Worker] = {}
        try:
            while True:
                self._assign()
                with self._lock:
                    if self._closing:
                        return
                workers = tuple((id(w), w.process.pid, w.on_loop) for w in self._workers)
                if selector is None or workers != watched:  # one replaced, or removed
                    if selector is not None:
                        selector.close()
                    selector, watched, owner = selectors.DefaultSelector(), workers, {}
                    selector.register(self._wake_r, selectors.EVENT_READ)
                    for w in self._workers:
                        owner[w.conn] = owner[w.process.sentinel] = w
                        if not w.on_loop:  # the loop reads it (see the module doc)
                            selector.register(w.conn, selectors.EVENT_READ)
                        selector.register(w.process.sentinel, selectors.EVENT_READ)
                found = selector.select(self._until_deadline())
                if not self._round([key.fileobj for key, _ in found], owner):
                    return
                self._expire()
        finally:
            if selector is not None:
                selector.close()

    def _round(self, ready: list[Any], owner: dict[Any, _Worker]) -> bool:
        """Handle what the dispatcher's wait found ready; False: the pool is closing."""
        for obj in ready:
            if obj is self._wake_r:
                with self._lock:
                    self._woken = False  # before _assign looks at the queue (_wake)
                self._wake_r.recv_bytes()
                continue
            w = owner[obj]
            if w not in self._workers:
                continue  # replaced earlier in this round
            if obj is w.conn:
                if not w.on_loop:  # handed to the loop earlier in this round
                    self._receive(w)
            elif not w.process.is_alive():
                with self._lock:
                    if self._closing:
                        return False
                    started = w.ready
                if started:
                    self._replace(w)
                else:  # died while starting: replacing it again would loop forever
                    log.error("a replacement worker exited with code %s while starting; "
                              "the pool shrinks", w.process.exitcode)
                    self._remove(w)
        return True

    def _until_deadline(self) -> float | None:
        """Seconds until the earliest batch deadline of a worker; None: no batch is out."""
        with self._lock:
            started = [w.head_since for w in self._workers if w.jobs]
        # The loop hands out tasks without waking this thread: it looks now and then.
        every = LOOK_EVERY if self._loop is not None else None
        if not started:
            return every
        left = max(0.0, min(started) + self._batch_timeout - time.monotonic())
        return left if every is None else min(left, every)

    def _expire(self) -> None:
        """Kill and replace each worker whose batch is past batch_timeout_seconds: it hangs
        (a read that never returns, a deadlock in user code); that batch fails, in-band, with
        what the worker was doing, and the client asks again (another server if it has one)."""
        now = time.monotonic()
        for w in list(self._workers):
            with self._lock:
                if not self._overdue(w, now):
                    continue
                # The task it is on: the first of its jobs, or a later one when it holds the
                # results of those before (see _worker_main.HOLD).
                at_task, at_sample = w.progress[0], w.progress[1]
                task = (w.jobs.get(at_task) or next(iter(w.jobs.values()))).task
                self._timeouts += 1
            where = (f"sample {at_sample}" if at_task == task.task_id and at_sample >= 0
                     else "its first sample")
            message = (f"not built within batch_timeout_seconds={self._batch_timeout:g} "
                       f"(dataset {task.dataset!r}: worker pid {w.process.pid} was at {where});"
                       " the worker was replaced")
            log.error("worker pid %s hangs: a batch of dataset %r was not built within "
                      "batch_timeout_seconds=%g (it was at %s); killing it and starting another",
                      w.process.pid, task.dataset, self._batch_timeout, where)
            w.process.kill()
            w.process.join(timeout=10)
            self._replace(w, hung=(task.task_id, message))

    def _assign(self, flush: bool = True) -> None:
        """Send each worker, in one pipe message, the segments given back and the tasks it
        has room for: a pipe write (and a wake-up of the worker) per round, not one per
        message (in steady state a freed segment and a task per batch: half the writes).
        The dispatcher's, or the loop's (see the module doc): one at a time. `flush`: the
        segments given back go to every worker that has some; else only with a task (the
        loop's, per batch: the rest within GIVE_BACK_WAIT, see release)."""
        with self._send_lock:
            self._assign_locked(flush)

    def _flush(self) -> None:
        """On the loop: the segments given back that no task took along, alone."""
        self._give_back = None
        self._assign(flush=True)

    def _assign_locked(self, flush: bool) -> None:
        with self._lock:
            if self._closing:  # close() stops the workers: a task now would be lost
                return
            tasks: dict[int, list[ToWorker]] = {id(w): [] for w in self._workers}
            ready = [w for w in self._workers if w.ready]
            while self._queue and ready:
                # The least busy worker takes the next task: a credit record's batches
                # spread across the workers, and each worker's share goes in one write.
                w = min(ready, key=lambda w: len(w.jobs))
                if len(w.jobs) >= self._depth:
                    break
                job = self._queue.popleft()
                if job.future.cancelled():
                    continue
                # Recorded first: if the worker is dead, _replace deals with the task.
                if not w.jobs:
                    w.head_since = time.monotonic()
                w.jobs[job.task.task_id] = job
                tasks[id(w)].append(job.task)
            out: list[tuple[_Worker, list[ToWorker]]] = []
            for w in self._workers:
                if not (flush or tasks[id(w)]):
                    continue
                messages: list[ToWorker] = []
                out.append((w, messages))
                if w.freed:  # before the tasks: they may reuse them
                    messages.append(GiveBack(w.freed))
                    w.freed = []
                if w.dropped:
                    messages.append(Discard(w.dropped))
                    w.dropped = []
                messages += tasks[id(w)]
        for w, messages in out:
            if messages:
                _send(w, messages[0] if len(messages) == 1 else tuple(messages))

    def _receive(self, w: _Worker) -> None:
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            return  # the sentinel reports the death
        self._settle_all(w, message)

    def _drain(self, w: _Worker) -> None:
        try:
            while w.conn.poll():
                self._settle_all(w, w.conn.recv())
        except (EOFError, OSError):
            pass

    def _settle_all(self, w: _Worker, received: FromWorker | tuple[FromWorker, ...]) -> None:
        """What one pipe message of `w` carries: a result, or several (a tuple, in order)."""
        for message in received if isinstance(received, tuple) else (received,):
            self._settle(w, message)

    def _settle(self, w: _Worker, message: FromWorker) -> None:
        match message:
            case Opened(_, prints):
                with self._lock:
                    closing = self._closing
                for name, seen in self._differing(prints):
                    if not closing:
                        self._refuse(w, name, seen)
                    return
                with self._lock:
                    w.ready = True
                if self._loop is not None and not closing:
                    self._hand_to_loop(w)
            case OpenFailed(reason):
                with self._lock:
                    closing = self._closing
                if not closing:
                    log.error("a replacement worker failed to start, the pool shrinks: %s",
                              reason)
                    self._remove(w)
            case Built(task_id, batch):
                with self._lock:
                    self._depth = depth_for(batch.payload_bytes)
                    if batch.num_samples and batch.build_seconds > 0:  # ISSUE 31 STOPGAP
                        per = batch.build_seconds / batch.num_samples
                        old = self._sample_seconds
                        self._sample_seconds = per if not old else 0.8 * old + 0.2 * per
                    job = w.jobs.pop(task_id, None)
                    w.head_since = time.monotonic()  # the next of its jobs starts now
                    self._lent.add(batch.shm_name)
                if job is None or not _resolve(job.future, batch):
                    self.release(batch)  # nobody waits for it any more
            case BuildFailed(task_id, kind, reason, detail):
                with self._lock:
                    job = w.jobs.pop(task_id, None)
                    w.head_since = time.monotonic()
                if job is not None:
                    _reject(job.future, BatchFailed(kind, reason, detail))
            case _:
                raise TypeError(f"a worker sent {message!r}")

    def _differing(self, prints: dict[str, Fingerprint]) -> list[tuple[str, Fingerprint]]:
        """The datasets a worker sees otherwise than the server opened them, with its view."""
        return [(name, prints.get(name) or Fingerprint("(none)", 0, 0))
                for name, m in self.meta.items()
                if m.fingerprint is not None and prints.get(name) != m.fingerprint]

    def _refuse(self, w: _Worker, name: str, seen: Fingerprint) -> None:
        """A replacement worker lists other data than the server opened (files added,
        changed or removed since): it must not serve, or the same coordinates would give
        other batches. It is stopped, and the pool shrinks; the other workers go on with the
        original listing."""
        why = (f"dataset {name!r}: a replacement worker (pid {w.process.pid}) sees other data "
               "than the server opened: "
               f"{_views('the server', self.meta[name].fingerprint, 'the worker', seen)}")
        with self._lock:
            self._refusal = (f"{why}; it was refused, and no worker is left to serve the data "
                             "this server listed: restart the server to serve the new data")
            left = sum(o.ready for o in self._workers if o is not w)
        log.error("%s; it is stopped and serves nothing (%d workers left, serving the data as "
                  "first listed): restart the server to serve the new data", why, left)
        _send(w, Stop())
        self._remove(w)

    def _replace(self, w: _Worker, hung: tuple[int, str] | None = None) -> None:
        """A worker died: fail the batch it was building, give its queued ones to others,
        and start a new worker (which takes tasks once it reports ready).
        `hung`: (task id, message) when the pool killed it for a batch past its deadline."""
        with self._lock:
            w.ready = False  # the loop hands it no more tasks: those it has are settled below
        self._unwatch(w)
        self._drain(w)
        code = w.process.exitcode
        if hung is None:
            log.error("worker pid %s died (exit code %s); starting another", w.process.pid, code)
            failed = f"worker process died (exit code {code}) while building it"
        else:
            failed = hung[1]
        with self._lock:
            jobs = list(w.jobs.values())
            w.jobs.clear()
            # The batch it was on fails; the others (queued, or built and held) go to other
            # workers. Killed for a hang, but that batch came in just before: none fails.
            on = hung[0] if hung is not None else w.progress[0]
            building = next((j for j in jobs if j.task.task_id == on), None)
            self._queue.extendleft(reversed([j for j in jobs if j is not building]))
        if building is not None:
            _reject(building.future, BatchFailed(FailureKind.INTERNAL, failed))
        w.conn.close()
        self._forget(w)
        new = self._spawn(probe=False, slot=self._workers.index(w))
        with self._lock:
            self._workers[self._workers.index(w)] = new

    def _forget(self, w: _Worker) -> None:
        """A worker is gone: unlink its idle segments; those the front end still holds are
        unlinked when it releases them."""
        with self._lock:
            self._by_pid.pop(w.process.pid, None)
            keep = set(self._lent)
        shm.remove_prefixed(shm.worker_prefix(os.getpid(), w.process.pid), keep)

    def _remove(self, w: _Worker) -> None:
        with self._lock:
            w.ready = False  # no more tasks from the loop
        self._unwatch(w)
        with self._lock:
            self._workers.remove(w)
            last = not self._workers
        w.conn.close()
        w.process.join(timeout=10)
        self._forget(w)
        if last:
            with self._lock:
                jobs = list(self._queue)
                self._queue.clear()
                refusal = self._refusal
            if refusal is not None:
                self._fail_all(jobs, refusal, FailureKind.UNAVAILABLE)
            else:
                self._fail_all(jobs, "no worker process could be started")

    @staticmethod
    def _fail_all(jobs: list[_Job], message: str,
                  kind: FailureKind = FailureKind.INTERNAL) -> None:
        for job in jobs:
            _reject(job.future, BatchFailed(kind, message))


def _views(a: str, fa: Fingerprint | None, b: str, fb: Fingerprint) -> str:
    """`worker 0 listed 40 objects (sha256:...), worker 2 listed 48 (sha256:...); added
    'aaa/' (8 objects)`: two views of one dataset, and what differs if the parts say."""
    if fa is None:
        return f"{b} has {fb.short()}"
    changes = fa.changes(fb)
    return (f"{a} has {fa.short()}, {b} has {fb.short()}"
            + (f"; {changes}" if changes else ""))


def _send(w: _Worker, message: ToWorker | tuple[ToWorker, ...]) -> bool:
    """Send to a worker (a tuple: several messages in one pipe write, taken in order);
    False if its pipe is broken: it died, and its sentinel will say so on the dispatcher's
    next wait (where _replace handles its tasks)."""
    try:
        w.conn.send(message)
    except OSError:
        return False
    return True


def _reject(fut: concurrent.futures.Future, error: BaseException) -> None:
    try:
        fut.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled: nobody waits


def _resolve(fut: concurrent.futures.Future[BuiltBatch], batch: BuiltBatch) -> bool:
    """Hand `batch` to its waiter; False if the waiter has gone (the caller frees it)."""
    try:
        fut.set_result(batch)
    except concurrent.futures.InvalidStateError:
        return False
    return True
