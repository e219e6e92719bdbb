"""A pool of worker processes that build batches into shared memory.

Workers are spawned (not forked): the front end runs gRPC threads, which do not survive fork.
Each worker opens every configured dataset itself; the front end never imports user code.
Tasks and results travel as small messages over one pipe per worker; batch payloads travel in
shared memory (see _batch.py), never through the pipe.

Threading contract: submit() may be called from any thread. One dispatcher thread owns the
pipes: it hands tasks to idle workers (at most DEPTH each, so a slow batch never holds up the
queue for long), resolves futures, and replaces workers that die.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _shm
from ._batch import BatchTooLarge, BuiltBatch, SampleError, build_batch, probe_fields
from ._sampling import EpochKey, Ordering

log = logging.getLogger("stoker.server")

# Tasks queued inside one worker: two lets a worker start the next batch without a round trip.
DEPTH = 2
# Free segments a worker keeps for reuse (see _shm.SegmentPool): enough for the batches it
# has queued plus those on their way out.
KEEP_SEGMENTS = DEPTH + 2


class StartError(RuntimeError):
    """The server cannot start: a dataset does not open, a port is taken. The message says
    which, in one line."""


class BatchFailed(Exception):
    """A batch could not be built; `kind` is 'data_loss', 'resource_exhausted' (over
    max_batch_bytes) or 'internal'."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class DatasetMeta:
    num_samples: int
    fields: list[tuple[str, str, tuple[int, ...]]]
    ordering: Ordering


def _describe(ds: Any, cfg: Any) -> DatasetMeta:
    ordering = Ordering(len(ds), getattr(ds, "shard_starts", None),
                        getattr(cfg, "shuffle", "global") == "block",
                        getattr(cfg, "shuffle_window", 1))
    return DatasetMeta(len(ds), probe_fields(ds), ordering)


def _prefetch(ds: Any, indices: np.ndarray) -> None:
    """Ask the dataset's storage to fetch what these samples read (a hint, never fails)."""
    objects_of = getattr(ds, "objects_of", None)
    storage = getattr(ds, "storage", None)
    if objects_of is None or storage is None or len(indices) == 0:
        return
    try:
        storage.prefetch(objects_of(indices))
    except Exception as e:  # the read itself will fail, and say why
        log.debug("prefetch hint failed: %s", e)


def _worker_main(config: Any, conn: mpc.Connection, probe: bool, log_level: int) -> None:
    # The parent owns shutdown and closes our pipe when it is time (or dies, and the pipe ends).
    # Ctrl-C, or a SIGTERM sent to the whole process group, must not kill us mid-batch first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Spawned: nothing of the server's logging setup came along. Same level, same stream.
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[worker]: %(message)s")
    from .formats import open_dataset

    cache = None
    if any(str(getattr(c, "source", "")).startswith("s3://") for c in config.datasets.values()):
        from .sources.cache import DiskCache

        cache = DiskCache(config.cache.dir, int(config.cache.max_bytes))
    datasets: dict[str, Any] = {}
    meta: dict[str, DatasetMeta] = {}
    for name in config.datasets:
        try:
            datasets[name] = ds = open_dataset(name, config, cache)
            if probe:
                meta[name] = _describe(ds, config.datasets[name])
        except Exception as e:
            conn.send(("failed", f"dataset {name!r}: {type(e).__name__}: {e}"))
            return
    conn.send(("ready", meta if probe else None))
    segments = _shm.SegmentPool(_shm.worker_prefix(os.getppid(), os.getpid()), KEEP_SEGMENTS)
    reported = (0, 0, 0)  # the cache's counters as of the last batch sent
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        if task[0] == "free":  # the front end has sent these batches: reuse their memory
            for name in task[1]:
                segments.give_back(name)
            continue
        if task[0] == "drop":  # a client may still read these: never write them again
            for name in task[1]:
                segments.discard(name)
            continue
        task_id, dataset, indices, ahead, key = task
        ds, skip = datasets[dataset], config.datasets[dataset].on_error == "skip"
        # This batch's objects in parallel, then those of a batch further on: a store's
        # first-byte latency is paid ahead of time, not once per sample in turn.
        _prefetch(ds, indices)
        _prefetch(ds, ahead)
        try:
            batch = build_batch(ds, indices, segments, key, skip,
                                int(config.server.max_batch_bytes))
            if cache is not None:  # what the cache did since the last batch, for /metrics
                now = (cache.hits, cache.misses, cache.bytes_fetched)
                batch = dataclasses.replace(
                    batch, cache=tuple(a - b for a, b in zip(now, reported, strict=True)))
                reported = now
            conn.send(("done", task_id, batch))
        except SampleError as e:
            conn.send(("error", task_id, "data_loss", f"dataset {dataset!r}: {e}"))
        except BatchTooLarge as e:
            conn.send(("error", task_id, "resource_exhausted", f"dataset {dataset!r}: {e}"))
        except Exception as e:
            conn.send(("error", task_id, "internal", f"{type(e).__name__}: {e}"))


@dataclass
class _Worker:
    process: Any
    conn: mpc.Connection
    ready: bool = False
    # Segments the front end has finished with, to send back on the next dispatcher round.
    freed: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # unlinked: the worker forgets them
    # Tasks sent to this worker, oldest first: the first is the one it is building.
    tasks: dict[int, tuple[str, np.ndarray, np.ndarray, EpochKey,
                           concurrent.futures.Future[BuiltBatch]]] = field(default_factory=dict)


_Task = tuple[int, str, np.ndarray, np.ndarray, EpochKey, concurrent.futures.Future]
_FIRST_EPOCH = EpochKey()
_NOTHING = np.zeros(0, np.int64)


class WorkerPool:
    def __init__(self, config: Any, processes: int) -> None:
        self._config = config
        self._n = processes
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._queue: collections.deque[_Task] = collections.deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._next_id = 0
        self._closing = False
        self._broken = False  # the dispatcher thread died of a bug
        self._thread: threading.Thread | None = None
        self._by_pid: dict[int, _Worker] = {}
        self._lent: set[str] = set()  # segments of built batches the front end holds
        self.meta: dict[str, DatasetMeta] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> dict[str, DatasetMeta]:
        """Start the workers and wait until each has opened every dataset.

        Raises StartError; call close() in any case, to stop those that did start."""
        orphans = _shm.sweep()
        if orphans:
            log.warning("removed %d shared-memory segments left by servers that died", orphans)
        for i in range(self._n):
            self._workers.append(self._spawn(probe=i == 0))
        for i, w in enumerate(self._workers):
            try:
                kind, payload = w.conn.recv()
            except EOFError:
                w.process.join()
                raise StartError(f"worker process exited with code "
                                       f"{w.process.exitcode} while starting") from None
            if kind == "failed":
                raise StartError(payload)
            w.ready = True
            if i == 0:
                self.meta = payload
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
        workers = list(self._workers)
        for w in workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in workers:
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            self._drain(w)
            self._fail_all([fut for *_, fut in w.tasks.values()], "server shutting down")
            w.conn.close()
        with self._lock:
            for *_, fut in self._queue:
                fut.cancel()
            self._queue.clear()
        # Whatever a stream or a worker still held: nothing of ours outlives the server.
        _shm.sweep(os.getpid())

    def release(self, batch: BuiltBatch, reuse: bool = True) -> None:
        """The front end is done with a built batch (sent, or nobody wants it): its segment
        goes back to the worker that made it, or is unlinked if that worker is gone.
        reuse=False: unlinked in any case (a client may still be reading it: its mapping
        stays valid, and the worker will not write into it again). Any thread."""
        name = batch.shm_name
        with self._lock:
            self._lent.discard(name)
            w = None if self._closing else self._by_pid.get(_shm.worker_of(name) or -1)
            if w is not None:
                (w.freed if reuse else w.dropped).append(name)
        if w is None or not reuse:
            _shm.unlink(name)
        if w is not None:
            self._wake_w.send_bytes(b"x")

    def status(self) -> dict[str, int]:
        """Workers ready, batches queued for a worker, batches handed to workers. Any thread."""
        with self._lock:
            return {"workers": sum(w.ready for w in self._workers) if not self._broken else 0,
                    "queued": len(self._queue),
                    "building": sum(len(w.tasks) for w in self._workers)}

    # -- submitting ------------------------------------------------------------------------
    def submit(self, dataset: str, indices: np.ndarray, ahead: np.ndarray = _NOTHING,
               key: EpochKey = _FIRST_EPOCH) -> concurrent.futures.Future[BuiltBatch]:
        """Build the batch of `indices` for the epoch `key`; `ahead`: samples a later batch
        will need (a hint)."""
        fut: concurrent.futures.Future[BuiltBatch] = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                raise BatchFailed("internal", "server shutting down")
            if not self._workers:
                raise BatchFailed("internal", "no worker process is running")
            if self._broken:
                raise BatchFailed("internal", "the server's worker dispatcher failed (see its log)")
            self._next_id += 1
            self._queue.append((self._next_id, dataset, indices, ahead, key, fut))
        self._wake_w.send_bytes(b"x")
        return fut

    # -- the dispatcher thread -------------------------------------------------------------
    def _spawn(self, probe: bool) -> _Worker:
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker_main,
                              args=(self._config, child, probe, log.getEffectiveLevel()),
                              name="stoker-worker", daemon=True)
        p.start()
        child.close()
        w = _Worker(p, parent)
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
                queued = [fut for *_, fut in self._queue]
                self._queue.clear()
            for w in self._workers:
                queued += [task[-1] for task in w.tasks.values()]
            self._fail_all(queued, "the server's worker dispatcher failed (see its log)")

    def _dispatch_loop(self) -> None:
        while True:
            self._assign()
            with self._lock:
                if self._closing:
                    return
            owner: dict[Any, _Worker] = {}
            for w in self._workers:
                owner[w.conn] = owner[w.process.sentinel] = w
            for ready in mpc.wait([self._wake_r, *owner]):
                if ready is self._wake_r:
                    self._wake_r.recv_bytes()
                    continue
                w = owner[ready]
                if w not in self._workers:
                    continue  # replaced earlier in this round
                if ready is w.conn:
                    self._receive(w)
                elif not w.process.is_alive():
                    with self._lock:
                        if self._closing:
                            return
                    if w.ready:
                        self._replace(w)
                    else:  # died while starting: replacing it again would loop forever
                        log.error("a replacement worker exited with code %s while starting; "
                                  "the pool shrinks", w.process.exitcode)
                        self._remove(w)

    def _assign(self) -> None:
        with self._lock:
            for w in self._workers:
                if w.freed:
                    _send(w, ("free", w.freed))
                    w.freed = []
                if w.dropped:
                    _send(w, ("drop", w.dropped))
                    w.dropped = []
            for w in sorted(self._workers, key=lambda w: len(w.tasks)):
                while w.ready and len(w.tasks) < DEPTH and self._queue:
                    task_id, dataset, indices, ahead, key, fut = self._queue.popleft()
                    if fut.cancelled():
                        continue
                    # Recorded first: if the worker is dead, _replace deals with the task.
                    w.tasks[task_id] = (dataset, indices, ahead, key, fut)
                    if not _send(w, (task_id, dataset, indices, ahead, key)):
                        break

    def _receive(self, w: _Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            return  # the sentinel reports the death
        self._settle(w, msg)

    def _drain(self, w: _Worker) -> None:
        try:
            while w.conn.poll():
                self._settle(w, w.conn.recv())
        except (EOFError, OSError):
            pass

    def _settle(self, w: _Worker, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            return
        if kind == "failed":
            if not self._closing:
                log.error("a replacement worker failed to start, the pool shrinks: %s", msg[1])
                self._remove(w)
            return
        task = w.tasks.pop(msg[1], None)
        fut = task[-1] if task else None
        if kind == "done":
            with self._lock:
                self._lent.add(msg[2].shm_name)
            if fut is None or not _resolve(fut, msg[2]):
                self.release(msg[2])  # nobody waits for it any more
        elif fut is not None:
            _reject(fut, BatchFailed(msg[2], msg[3]))

    def _replace(self, w: _Worker) -> None:
        """A worker died: fail the batch it was building, give its queued ones to others,
        and start a new worker (which takes tasks once it reports ready)."""
        self._drain(w)
        code = w.process.exitcode
        log.error("worker pid %s died (exit code %s); starting another", w.process.pid, code)
        tasks = list(w.tasks.items())
        w.tasks.clear()
        if tasks:
            _reject(tasks[0][1][-1], BatchFailed(
                "internal", f"worker process died (exit code {code}) while building it"))
        with self._lock:
            for task_id, task in reversed(tasks[1:]):
                self._queue.appendleft((task_id, *task))
        w.conn.close()
        self._forget(w)
        self._workers[self._workers.index(w)] = self._spawn(probe=False)

    def _forget(self, w: _Worker) -> None:
        """A worker is gone: unlink its idle segments; those the front end still holds are
        unlinked when it releases them."""
        with self._lock:
            self._by_pid.pop(w.process.pid, None)
            keep = set(self._lent)
        _shm.remove_prefixed(_shm.worker_prefix(os.getpid(), w.process.pid), keep)

    def _remove(self, w: _Worker) -> None:
        self._workers.remove(w)
        w.conn.close()
        w.process.join(timeout=10)
        self._forget(w)
        if not self._workers:
            with self._lock:
                queued = [fut for *_, fut in self._queue]
                self._queue.clear()
            self._fail_all(queued, "no worker process could be started")

    @staticmethod
    def _fail_all(futures: list[concurrent.futures.Future], message: str) -> None:
        for fut in futures:
            _reject(fut, BatchFailed("internal", message))


def _send(w: _Worker, message: Any) -> bool:
    """Send to a worker; False if its pipe is broken: it died, and its sentinel will say so
    on the dispatcher's next wait (where _replace handles its tasks)."""
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

