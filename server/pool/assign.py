"""Which worker builds which batch: the queue of batches waiting for a worker, the tasks each
worker holds (at most `depth`), their futures, and the segments the front end holds.

A batch cut into parts (see parts.py) is queued as one job per part, all with the batch's
future: parts are handed out, counted in the depth and taken back when a worker dies like
tasks; a part's result settles its batch's Assembly, and the last one in decides the batch.

Bookkeeping only: nothing here reads or writes a pipe, starts a process or runs a thread, so
it can be driven (and tested) with any WorkerHandle. Threading: every field of an Assignment,
and each worker's `ready`, `freed`, `dropped`, `jobs` and `head_since`, are guarded by `lock`,
the pool's one lock (a task handed out reads the worker list and the queue at once). Methods
named `..._locked` expect the caller to hold it; the others take it. Futures are resolved
outside it (a waiter's callback may call back into the pool).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from ..order.sampling import EpochKey
from .depth import SHALLOW_DEPTH, depth_for
from .fair_queue import FairQueue
from .handle import Job, WorkerHandle
from .layout import BuiltBatch
from .messages import BatchFailed, Discard, FailureKind, GiveBack, PartBuilt, Task, ToWorker
from .parts import RESENDS, Assembly, OwnSegments, Plan, Splitter, Verdict

__all__ = ["Assignment", "fail_all"]


class Assignment:
    """The batches waiting for a worker and those each worker has; guarded by `lock` (see
    the module doc)."""

    def __init__(self, lock: threading.Lock, batch_timeout: float) -> None:
        self.lock = lock
        self.queue: FairQueue[Job] = FairQueue()  # fair between lanes (fair_queue.py)
        self.next_id = 0
        self.lent: set[str] = set()  # segments of built batches the front end holds
        # Tasks per worker, by the size of the latest batch built (see depth.DEPTH).
        self.depth = SHALLOW_DEPTH
        # A batch a worker has been on longer than this: the worker hangs (see dispatch.py).
        self.batch_timeout = batch_timeout
        self.closing = False  # close() stops the workers: no task is handed out any more
        self.broken = False  # the dispatcher thread died of a bug: no task is taken
        # Which batches are cut into parts (set when the pool starts: it needs the probe),
        # and the segments those are built into.
        self.splitter = Splitter({}, 0)
        self.segments: OwnSegments | None = None
        # Batches whose parts are all in, with what their futures get (outside the lock).
        self._settled: list[tuple[Assembly, BuiltBatch | BatchFailed]] = []

    def add_locked(self, dataset: str, indices: np.ndarray, ahead: np.ndarray,
                   key: EpochKey, sources: bool = False, lane: Hashable = None
                   ) -> concurrent.futures.Future[BuiltBatch]:
        """Queue the batch of `indices` (or, `sources`, where they come from) in `lane`
        (who asked: the queue is fair between lanes); its future."""
        fut: concurrent.futures.Future[BuiltBatch] = concurrent.futures.Future()
        self.next_id += 1
        self.queue.add([Job(Task(self.next_id, dataset, indices, ahead, key, sources), fut)],
                       lane)
        return fut

    def add_parts_locked(self, dataset: str, indices: np.ndarray, ahead: np.ndarray,
                         key: EpochKey, plan: Plan, segment: str, lane: Hashable = None
                         ) -> concurrent.futures.Future[BuiltBatch]:
        """Queue the batch of `indices` as `plan`'s parts, built into `segment` (the pool's,
        lent to the batch) in `lane`; its future."""
        fut: concurrent.futures.Future[BuiltBatch] = concurrent.futures.Future()
        self.next_id += 1
        batch = Assembly(Task(self.next_id, dataset, indices, ahead, key), fut, segment, plan)
        parts = batch.cut(self.next_id + 1)
        self.next_id += len(parts)
        self.queue.add([Job(p, fut, batch, k) for k, p in enumerate(parts)], lane)
        return fut

    def deal_locked(self, workers: Sequence[WorkerHandle], flush: bool
                    ) -> list[tuple[WorkerHandle, list[ToWorker]]]:
        """Hand the queued tasks to the ready workers that have room, and what each is to be
        sent now: segments given back first (the tasks may reuse them), then its tasks; the
        caller sends each list in one pipe write. `flush`: the segments given back go to
        every worker that has some; else only with a task."""
        if self.closing:  # close() stops the workers: a task now would be lost
            return []
        tasks: dict[int, list[ToWorker]] = {id(w): [] for w in workers}
        ready = [w for w in workers if w.ready]
        while self.queue and ready:
            # The least busy worker takes the next task: a credit record's batches spread
            # across the workers, and each worker's share goes in one write.
            w = min(ready, key=lambda w: len(w.jobs))
            if len(w.jobs) >= self.depth:
                break
            job = self.queue.pop()
            if job.future.cancelled():
                if job.batch is not None:  # its segment comes back once no part is out
                    self._conclude_locked(job, job.batch.settle_locked(job.part, None))
                continue
            # Recorded first: if the worker is dead, take_back_locked deals with the task.
            if not w.jobs:
                w.head_since = time.monotonic()
            w.jobs[job.task.task_id] = job
            tasks[id(w)].append(job.task)
        out: list[tuple[WorkerHandle, list[ToWorker]]] = []
        for w in workers:
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
        return out

    def built(self, w: WorkerHandle, task_id: int, batch: BuiltBatch) -> bool:
        """`w` built task `task_id`: its future gets the batch, which the front end now holds.
        False: nobody waits for it any more (the caller releases it)."""
        with self.lock:
            self.depth = depth_for(batch.payload_bytes, batch.build_seconds)
            job = w.jobs.pop(task_id, None)
            w.head_since = time.monotonic()  # the next of its jobs starts now
            self.lent.add(batch.shm_name)
            if job is not None:
                self.splitter.measured_locked(job.task.dataset, batch.build_seconds,
                                              batch.num_samples)
        return job is not None and _resolve(job.future, batch)

    def failed(self, w: WorkerHandle, task_id: int, error: BatchFailed | str) -> None:
        """`w` could not build task `task_id`: its future fails with `error` (a part's
        batch, once all its parts are in; parts.MISFIT: the batch is built whole)."""
        with self.lock:
            job = w.jobs.pop(task_id, None)
            w.head_since = time.monotonic()
        if job is not None:
            self.fail_jobs([job], error)

    def part_built(self, w: WorkerHandle, built: PartBuilt) -> None:
        """`w` wrote a part's rows."""
        with self.lock:
            job = w.jobs.pop(built.task_id, None)
            w.head_since = time.monotonic()
            if job is None or job.batch is None:
                return
            self.splitter.measured_locked(job.task.dataset, built.seconds,
                                          len(job.task.indices))
            self._conclude_locked(job, job.batch.settle_locked(job.part, built))
        self._resolve_settled()

    def fail_jobs(self, jobs: Iterable[Job], error: BatchFailed | str) -> None:
        """These jobs failed with `error`: a task's future at once; a part's batch once all
        its parts are in."""
        for job in jobs:
            if job.batch is None:
                if not isinstance(error, str):
                    _reject(job.future, error)
                continue
            with self.lock:
                self._conclude_locked(job, job.batch.settle_locked(job.part, error))
        self._resolve_settled()

    def _conclude_locked(self, job: Job, verdict: Verdict | None) -> None:
        """What becomes of a part's batch now that all its parts are in (None: not yet).
        Its future is resolved by _resolve_settled, outside the lock (a waiter's callback
        may call back into the pool)."""
        batch = job.batch
        if verdict is None or batch is None:
            return
        assert self.segments is not None
        if verdict is Verdict.BUILT:
            built = batch.batch()
            self.depth = depth_for(built.payload_bytes, built.build_seconds)
            self.lent.add(built.shm_name)
            self._settled.append((batch, built))
            return
        if verdict is Verdict.WHOLE:  # before the batches queued after it
            self.splitter.misfit_locked(batch.whole.dataset)
            self.queue.put_back([Job(batch.whole, batch.future)])
        elif verdict is Verdict.FAILED:
            self._settled.append((batch, batch.error()))
        self.segments.give_back(batch.segment)

    def _resolve_settled(self) -> None:
        """Resolve the futures of the batches whose parts are all in; a batch nobody waits
        for any more goes back. Outside the lock."""
        with self.lock:
            settled, self._settled = self._settled, []
        for batch, outcome in settled:
            if isinstance(outcome, BuiltBatch):
                if not _resolve(batch.future, outcome):
                    with self.lock:
                        self.lent.discard(outcome.shm_name)
                    assert self.segments is not None
                    self.segments.give_back(outcome.shm_name)
            else:
                _reject(batch.future, outcome)

    def overdue_locked(self, w: WorkerHandle, now: float) -> bool:
        """Whether `w` is past its batch's deadline."""
        return bool(w.jobs) and now - w.head_since > self.batch_timeout

    def first_start_locked(self, workers: Iterable[WorkerHandle]) -> float | None:
        """When the oldest batch a worker is on started; None: no batch is out."""
        return min((w.head_since for w in workers if w.jobs), default=None)

    def take_back_locked(self, w: WorkerHandle, on: int, resend: bool = True) -> Job | None:
        """`w` is gone: its tasks go back to the front of the queue, in order, for other
        workers, except task `on` (the one it was building), which is returned: it fails.
        A part it was building goes back too (`resend`: its worker died, not hung), RESENDS
        times at most: writing its rows again writes the same bytes."""
        jobs = list(w.jobs.values())
        w.jobs.clear()
        building = next((j for j in jobs if j.task.task_id == on), None)
        if building is not None and building.batch is not None and resend:
            times = building.batch.resent.get(building.part, 0)
            if times < RESENDS:
                building.batch.resent[building.part] = times + 1
                building = None
        self.queue.put_back([j for j in jobs if j is not building])
        return building

    def clear_locked(self) -> list[Job]:
        """Empty the queue; what was in it."""
        return self.queue.clear()


def fail_all(jobs: Iterable[Job], message: str, kind: FailureKind = FailureKind.INTERNAL) -> None:
    for job in jobs:
        _reject(job.future, BatchFailed(kind, message))


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
