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
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _shm
from ._batch import BuiltBatch, SampleError, build_batch, probe_fields

log = logging.getLogger("stoker.server")

# Tasks queued inside one worker: two lets a worker start the next batch without a round trip.
DEPTH = 2


class WorkerStartError(RuntimeError):
    """A worker could not open the configured datasets."""


class BatchFailed(Exception):
    """A batch could not be built; `kind` is 'data_loss' or 'internal'."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class DatasetMeta:
    num_samples: int
    fields: list[tuple[str, str, tuple[int, ...]]]


def release(batch: BuiltBatch) -> None:
    """Free a built batch's shared memory (after sending it, or when nobody wants it)."""
    _shm.unlink(batch.shm_name)


def _worker_main(config: Any, conn: mpc.Connection, probe: bool) -> None:
    # The parent owns shutdown and closes our pipe when it is time (or dies, and the pipe ends).
    # Ctrl-C, or a SIGTERM sent to the whole process group, must not kill us mid-batch first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from .formats import open_dataset

    datasets: dict[str, Any] = {}
    try:
        for name, cfg in config.datasets.items():
            datasets[name] = open_dataset(cfg)
        meta = None
        if probe:
            meta = {n: DatasetMeta(len(ds), probe_fields(ds)) for n, ds in datasets.items()}
    except Exception as e:
        which = next((n for n in config.datasets if n not in datasets), "?")
        conn.send(("failed", f"dataset {which!r}: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", meta))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        task_id, dataset, indices = task
        try:
            conn.send(("done", task_id, build_batch(datasets[dataset], indices)))
        except SampleError as e:
            conn.send(("error", task_id, "data_loss", f"dataset {dataset!r}: {e}"))
        except Exception as e:
            conn.send(("error", task_id, "internal", f"{type(e).__name__}: {e}"))


@dataclass
class _Worker:
    process: Any
    conn: mpc.Connection
    tasks: dict[int, concurrent.futures.Future[BuiltBatch]] = field(default_factory=dict)


class WorkerPool:
    def __init__(self, config: Any, processes: int) -> None:
        self._config = config
        self._n = processes
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._queue: collections.deque[tuple[int, str, np.ndarray, concurrent.futures.Future]]
        self._queue = collections.deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._next_id = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self.meta: dict[str, DatasetMeta] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> dict[str, DatasetMeta]:
        """Start the workers and wait until each has opened every dataset."""
        orphans = _shm.sweep()
        if orphans:
            log.warning("removed %d shared-memory segments left by servers that died", orphans)
        for i in range(self._n):
            self._workers.append(self._spawn(probe=i == 0))
        for i, w in enumerate(self._workers):
            msg = self._await_ready(w)
            if i == 0:
                self.meta = msg
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
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            self._drain_results(w)
            self._fail(w.tasks, "internal", "server shutting down")
            w.conn.close()
        with self._lock:
            for *_, fut in self._queue:
                fut.cancel()
            self._queue.clear()
        # Whatever a stream or a worker still held: nothing of ours outlives the server.
        _shm.sweep(os.getpid())

    # -- submitting ------------------------------------------------------------------------
    def submit(self, dataset: str, indices: np.ndarray) -> concurrent.futures.Future[BuiltBatch]:
        fut: concurrent.futures.Future[BuiltBatch] = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                raise BatchFailed("internal", "server shutting down")
            if not self._workers:
                raise BatchFailed("internal", "no worker process is running")
            self._next_id += 1
            self._queue.append((self._next_id, dataset, indices, fut))
        self._wake_w.send_bytes(b"x")
        return fut

    # -- internals -------------------------------------------------------------------------
    def _spawn(self, probe: bool) -> _Worker:
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker_main, args=(self._config, child, probe),
                              name="stoker-worker", daemon=True)
        p.start()
        child.close()
        return _Worker(p, parent)

    def _await_ready(self, w: _Worker) -> Any:
        try:
            kind, payload = w.conn.recv()
        except EOFError:
            w.process.join()
            raise WorkerStartError(
                f"worker process exited with code {w.process.exitcode} while starting") from None
        if kind == "failed":
            raise WorkerStartError(payload)
        return payload

    def _dispatch(self) -> None:
        while True:
            self._assign()
            with self._lock:
                if self._closing:
                    return
            waitables: list[Any] = [self._wake_r]
            for w in self._workers:
                waitables += [w.conn, w.process.sentinel]
            for ready in mpc.wait(waitables):
                if ready is self._wake_r:
                    self._wake_r.recv_bytes()
                    continue
                w = next(w for w in self._workers if ready in (w.conn, w.process.sentinel))
                if ready is w.conn:
                    self._receive(w)
                elif not w.process.is_alive():
                    with self._lock:
                        closing = self._closing
                    if not closing:
                        self._replace(w)

    def _assign(self) -> None:
        with self._lock:
            for w in sorted(self._workers, key=lambda w: len(w.tasks)):
                while len(w.tasks) < DEPTH and self._queue:
                    task_id, dataset, indices, fut = self._queue.popleft()
                    if fut.cancelled():
                        continue
                    w.tasks[task_id] = fut
                    w.conn.send((task_id, dataset, indices))

    def _receive(self, w: _Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            return  # the sentinel reports the death
        self._settle(w, msg)

    def _drain_results(self, w: _Worker) -> None:
        try:
            while w.conn.poll():
                self._settle(w, w.conn.recv())
        except (EOFError, OSError):
            pass

    def _settle(self, w: _Worker, msg: tuple) -> None:
        kind, task_id = msg[0], msg[1]
        fut = w.tasks.pop(task_id, None)
        if kind == "done":
            batch = msg[2]
            if fut is None or not _resolve(fut, batch):
                release(batch)  # nobody waits for it any more
        elif fut is not None and not fut.cancelled():
            try:
                fut.set_exception(BatchFailed(msg[2], msg[3]))
            except concurrent.futures.InvalidStateError:
                pass

    def _replace(self, w: _Worker) -> None:
        self._drain_results(w)
        code = w.process.exitcode
        log.error("worker pid %s died (exit code %s); starting another", w.process.pid, code)
        self._fail(w.tasks, "internal", f"worker process died (exit code {code}) building it")
        w.conn.close()
        new = self._spawn(probe=False)
        try:
            self._await_ready(new)
        except WorkerStartError as e:
            log.error("replacement worker failed to start, pool shrinks by one: %s", e)
            self._workers.remove(w)
            if not self._workers:
                with self._lock:
                    queued = {t[0]: t[3] for t in self._queue}
                    self._queue.clear()
                self._fail(queued, "internal", "no worker process could be started")
            return
        self._workers[self._workers.index(w)] = new

    @staticmethod
    def _fail(tasks: dict[int, concurrent.futures.Future], kind: str, message: str) -> None:
        for fut in tasks.values():
            if not fut.cancelled():
                try:
                    fut.set_exception(BatchFailed(kind, message))
                except concurrent.futures.InvalidStateError:
                    pass
        tasks.clear()


def _resolve(fut: concurrent.futures.Future[BuiltBatch], batch: BuiltBatch) -> bool:
    """Hand `batch` to its waiter; False if the waiter has gone (the caller frees it)."""
    try:
        fut.set_result(batch)
    except concurrent.futures.InvalidStateError:
        return False
    return True

