"""The workers' lives: spawning them, waiting for each to open every dataset, refusing one that
sees other data than worker 0 did, replacing one that died, removing one that cannot start.

Workers are spawned (not forked): the front end runs gRPC threads, which do not survive fork.
Each worker opens every configured dataset itself (`main`, by default pool/worker_main.py); the
front end never imports user code.

Threading: open() runs on the thread that starts the pool, before the dispatcher thread starts;
from then on the dispatcher thread is the only one that changes `workers` (it replaces and
removes workers), and may read it without the lock; others read it under the pool's lock,
which also guards `by_pid`, `refusal` and the workers' bookkeeping (see handle.py). `meta` is
set by open() and never changes after. No pipe is read, and no process started or joined,
while holding the lock.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .._errors import StartError
from ..order.fingerprint import Fingerprint
from . import shm
from .assign import Assignment, fail_all
from .handle import WorkerHandle, send
from .layout import BuiltBatch
from .loop_side import LoopSide
from .messages import (
    BatchFailed,
    BuildFailed,
    Built,
    DatasetMeta,
    FailureKind,
    FromWorker,
    Misfit,
    Opened,
    OpenFailed,
    PartBuilt,
    Stop,
)
from .parts import MISFIT

log = logging.getLogger("stoker.server")


class WorkerMain(Protocol):
    """A worker process's body (pool/worker_main.worker_main; tests give a fake): it answers
    over `conn` as pool/messages.py says. Must be picklable: workers are spawned."""

    def __call__(self, config: Any, conn: mpc.Connection, probe: bool, log_level: int,
                 progress: Any = None, slot: int = 0, cache_counts: Any = None) -> None: ...


class Workers:
    """The worker processes; see the module doc for who may change what."""

    def __init__(self, config: Any, processes: int, ctx: Any, jobs: Assignment,
                 loop_side: LoopSide, release: Callable[[BuiltBatch], None],
                 main: WorkerMain) -> None:
        self._config = config
        self._n = processes
        self._ctx = ctx  # a multiprocessing context that spawns
        self._jobs = jobs
        self._lock: threading.Lock = jobs.lock
        self._loop_side = loop_side
        self._release = release  # a built batch nobody waits for goes back
        self._main = main
        self.workers: list[WorkerHandle] = []
        # Each slot's disk cache counters [hits, misses, bytes fetched]: its workers add to
        # them (a replacement to its predecessor's), /metrics reads them (cache_counts()).
        self._cache_counts = [ctx.RawArray("q", 3) for _ in range(processes)]
        self.by_pid: dict[int, WorkerHandle] = {}
        self.meta: dict[str, DatasetMeta] = {}
        # Why the last replacement worker was refused (its data differs): what batches
        # fail with once no worker is left.
        self.refusal: str | None = None

    def open(self) -> dict[str, DatasetMeta]:
        """Start the workers, wait until each has opened every dataset (worker 0 describes
        them), and hand their pipes to the loop. Raises StartError."""
        for i in range(self._n):
            w = self.spawn(probe=i == 0, slot=i)
            with self._lock:
                self.workers.append(w)
        for i, w in enumerate(list(self.workers)):
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
        for w in self.workers:
            self._loop_side.hand_over(w, self.settle_all)
        return self.meta

    def cache_counts(self) -> tuple[int, int, int]:
        """The disk cache's hits, misses and bytes fetched, over every worker (past ones
        included) up to now. Any thread: each is a sum of int64 loads."""
        return tuple(sum(c[i] for c in self._cache_counts) for i in range(3))

    def spawn(self, probe: bool, slot: int) -> WorkerHandle:
        """Start a worker; `slot`: its place in the pool (a replacement takes the one of the
        worker it replaces), which names it in `ps`."""
        parent, child = self._ctx.Pipe()
        progress = self._ctx.RawArray("q", [0, -1])
        p = self._ctx.Process(target=self._main,
                              args=(self._config, child, probe, log.getEffectiveLevel(),
                                    progress, slot, self._cache_counts[slot]),
                              name="stoker-worker", daemon=True)
        p.start()
        child.close()
        w = WorkerHandle(p, parent, progress=progress)
        with self._lock:
            self.by_pid[p.pid] = w
        return w

    # -- what a worker sends ---------------------------------------------------------------
    def receive(self, w: WorkerHandle) -> None:
        """Read one pipe message of `w` (the caller's thread owns its pipe)."""
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            return  # the sentinel reports the death
        self.settle_all(w, message)

    def drain(self, w: WorkerHandle) -> None:
        """Read what `w` has sent and not yet been read (the caller's thread owns its pipe)."""
        try:
            while w.conn.poll():
                self.settle_all(w, w.conn.recv())
        except (EOFError, OSError):
            pass

    def settle_all(self, w: WorkerHandle, received: FromWorker | tuple[FromWorker, ...]) -> None:
        """What one pipe message of `w` carries: a result, or several (a tuple, in order)."""
        for message in received if isinstance(received, tuple) else (received,):
            self._settle(w, message)

    def _settle(self, w: WorkerHandle, message: FromWorker) -> None:
        match message:
            case Opened(_, prints):  # a replacement worker is ready
                with self._lock:
                    closing = self._jobs.closing
                for name, seen in self._differing(prints):
                    if not closing:
                        self._refuse(w, name, seen)
                    return
                with self._lock:
                    w.ready = True
                if not closing:
                    self._loop_side.hand_over(w, self.settle_all)
            case OpenFailed(reason):
                with self._lock:
                    closing = self._jobs.closing
                if not closing:
                    log.error("a replacement worker failed to start, the pool shrinks: %s",
                              reason)
                    self.remove(w)
            case Built(task_id, batch):
                if not self._jobs.built(w, task_id, batch):
                    self._release(batch)  # nobody waits for it any more
            case BuildFailed(task_id, kind, reason, detail):
                self._jobs.failed(w, task_id, BatchFailed(kind, reason, detail))
            case PartBuilt():
                self._jobs.part_built(w, message)
            case Misfit(task_id):
                self._jobs.failed(w, task_id, MISFIT)
            case _:
                raise TypeError(f"a worker sent {message!r}")

    # -- worker 0's view of the data is the pool's ------------------------------------------
    def _differing(self, prints: dict[str, Fingerprint]) -> list[tuple[str, Fingerprint]]:
        """The datasets a worker sees otherwise than the server opened them, with its view."""
        return [(name, prints.get(name) or Fingerprint("(none)", 0, 0))
                for name, m in self.meta.items()
                if m.fingerprint is not None and prints.get(name) != m.fingerprint]

    def _refuse(self, w: WorkerHandle, name: str, seen: Fingerprint) -> None:
        """A replacement worker lists other data than the server opened (files added,
        changed or removed since): it must not serve, or the same coordinates would give
        other batches. It is stopped, and the pool shrinks; the other workers go on with the
        original listing."""
        why = (f"dataset {name!r}: a replacement worker (pid {w.process.pid}) sees other data "
               "than the server opened: "
               f"{_views('the server', self.meta[name].fingerprint, 'the worker', seen)}")
        with self._lock:
            self.refusal = (f"{why}; it was refused, and no worker is left to serve the data "
                            "this server listed: restart the server to serve the new data")
            left = sum(o.ready for o in self.workers if o is not w)
        log.error("%s; it is stopped and serves nothing (%d workers left, serving the data as "
                  "first listed): restart the server to serve the new data", why, left)
        send(w, Stop())
        self.remove(w)

    # -- the dispatcher's: a worker goes ---------------------------------------------------
    def replace(self, w: WorkerHandle, hung: tuple[int, str] | None = None) -> None:
        """A worker died: fail the batch it was building, give its queued ones to others,
        and start a new worker (which takes tasks once it reports ready).
        `hung`: (task id, message) when the pool killed it for a batch past its deadline."""
        with self._lock:
            w.ready = False  # the loop hands it no more tasks: those it has are settled below
        self._loop_side.take_back(w)
        self.drain(w)
        code = w.process.exitcode
        if hung is None:
            log.error("worker pid %s died (exit code %s); starting another", w.process.pid, code)
            failed = f"worker process died (exit code {code}) while building it"
        else:
            failed = hung[1]
        with self._lock:
            # The batch it was on fails (a part of one is sent again, if its worker died);
            # the others (queued, or built and held) go to other workers. Killed for a hang,
            # but that batch came in just before: none fails.
            building = self._jobs.take_back_locked(
                w, hung[0] if hung is not None else w.progress[0], resend=hung is None)
        if building is not None:
            self._jobs.fail_jobs([building], BatchFailed(FailureKind.INTERNAL, failed))
        w.conn.close()
        self._forget(w)
        new = self.spawn(probe=False, slot=self.workers.index(w))
        with self._lock:
            self.workers[self.workers.index(w)] = new

    def remove(self, w: WorkerHandle) -> None:
        """A worker that cannot serve goes, and the pool shrinks; once none is left, the
        queued batches fail (with the refusal, if that was why)."""
        with self._lock:
            w.ready = False  # no more tasks from the loop
        self._loop_side.take_back(w)
        with self._lock:
            self.workers.remove(w)
            last = not self.workers
        w.conn.close()
        w.process.join(timeout=10)
        self._forget(w)
        if last:
            with self._lock:
                jobs = self._jobs.clear_locked()
                refusal = self.refusal
            if refusal is not None:
                fail_all(jobs, refusal, FailureKind.UNAVAILABLE)
            else:
                fail_all(jobs, "no worker process could be started")

    def _forget(self, w: WorkerHandle) -> None:
        """A worker is gone: unlink its idle segments; those the front end still holds are
        unlinked when it releases them."""
        with self._lock:
            self.by_pid.pop(w.process.pid, None)
            keep = set(self._jobs.lent)
        shm.remove_prefixed(shm.worker_prefix(os.getpid(), w.process.pid), keep)


def _views(a: str, fa: Fingerprint | None, b: str, fb: Fingerprint) -> str:
    """`worker 0 listed 40 objects (sha256:...), worker 2 listed 48 (sha256:...); added
    'aaa/' (8 objects)`: two views of one dataset, and what differs if the parts say."""
    if fa is None:
        return f"{b} has {fb.short()}"
    changes = fa.changes(fb)
    return (f"{a} has {fa.short()}, {b} has {fb.short()}"
            + (f"; {changes}" if changes else ""))
