"""The dispatcher thread: it watches the workers' lives. It reads a starting worker's pipe
until the worker is ready (then the loop reads it, see loop_side.py), replaces a worker that
dies, and one that hangs: a batch not built within batch_timeout_seconds fails (INTERNAL,
naming the worker and the sample it was at; clients retry it) and its worker is killed and
replaced. It also hands out tasks submitted, and segments released, off the loop (a wake-up
through its pipe says there are some).

Threading: the dispatcher thread is the only one that changes the worker list once the pool
has started (see lifecycle.py). `woken` and `timeouts` are guarded by the pool's lock.
"""

from __future__ import annotations

import logging
import selectors
import threading
import time
from collections.abc import Callable
from typing import Any

from .assign import Assignment, fail_all
from .lifecycle import Workers

log = logging.getLogger("stoker.server")

# Seconds the dispatcher sleeps at most while the loop hands out tasks (it then learns of a
# batch's deadline only by looking): how late, at most, a hung worker is found.
LOOK_EVERY = 0.25


class Dispatcher:
    """The thread that watches the workers; `assign()`: the pool's hand-out of queued tasks
    and segments given back (see WorkerPool._assign)."""

    def __init__(self, ctx: Any, workers: Workers, jobs: Assignment,
                 assign: Callable[[], None]) -> None:
        self._workers = workers
        self._jobs = jobs
        self._lock = jobs.lock
        self._assign = assign
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)
        # A wake-up is in the pipe and the dispatcher has not taken it yet: submit() and
        # release() then write none (one pipe write, not one per batch; see wake_locked).
        self._woken = False
        self.timeouts = 0  # workers replaced for a batch past its deadline
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._dispatch, name="stoker-dispatch",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Wake the thread (the caller has set the pool closing) and wait for it to end."""
        self.write_wake()
        if self._thread:
            self._thread.join(timeout=30)

    def wake_locked(self) -> bool:
        """Whether the caller, having queued work under the lock, must write a wake-up
        (write_wake, after the lock): not if one is already in the pipe. The dispatcher
        clears the flag under the lock before it looks at the work, so what was queued
        before is seen then, and what comes after writes again. Saves a pipe write (and a
        dispatcher round) per batch when credits and releases come faster than the
        dispatcher turns."""
        woken, self._woken = self._woken, True
        return not woken

    def write_wake(self) -> None:
        self._wake_w.send_bytes(b"x")

    def _dispatch(self) -> None:
        try:
            self._dispatch_loop()
        except Exception:  # a bug: say so, and fail every batch instead of stalling them
            log.exception("the worker dispatcher failed; this server can build no batch")
            with self._lock:
                self._jobs.broken = True
                jobs = self._jobs.clear_locked()
                for w in self._workers.workers:
                    jobs += w.jobs.values()
            fail_all(jobs, "the server's worker dispatcher failed (see its log)")

    def _dispatch_loop(self) -> None:
        # One selector for as long as the workers stay the same (mpc.wait makes and fills a
        # new one per call: about a fifth of this thread's time per batch at 64 KiB).
        selector: selectors.BaseSelector | None = None
        watched: tuple[tuple[int, int, bool], ...] = ()
        owner: dict[Any, Any] = {}
        try:
            while True:
                self._assign()
                with self._lock:
                    if self._jobs.closing:
                        return
                current = self._workers.workers
                workers = tuple((id(w), w.process.pid, w.on_loop) for w in current)
                if selector is None or workers != watched:  # one replaced, or removed
                    if selector is not None:
                        selector.close()
                    selector, watched, owner = selectors.DefaultSelector(), workers, {}
                    selector.register(self._wake_r, selectors.EVENT_READ)
                    for w in current:
                        owner[w.conn] = owner[w.process.sentinel] = w
                        if not w.on_loop:  # the loop reads it (see loop_side.py)
                            selector.register(w.conn, selectors.EVENT_READ)
                        selector.register(w.process.sentinel, selectors.EVENT_READ)
                found = selector.select(self._until_deadline())
                if not self._round([key.fileobj for key, _ in found], owner):
                    return
                self._expire()
        finally:
            if selector is not None:
                selector.close()

    def _round(self, ready: list[Any], owner: dict[Any, Any]) -> bool:
        """Handle what the dispatcher's wait found ready; False: the pool is closing."""
        for obj in ready:
            if obj is self._wake_r:
                with self._lock:
                    self._woken = False  # before _assign looks at the queue (wake_locked)
                self._wake_r.recv_bytes()
                continue
            w = owner[obj]
            if w not in self._workers.workers:
                continue  # replaced earlier in this round
            if obj is w.conn:
                if not w.on_loop:  # handed to the loop earlier in this round
                    self._workers.receive(w)
            elif not w.process.is_alive():
                with self._lock:
                    if self._jobs.closing:
                        return False
                    started = w.ready
                if started:
                    self._workers.replace(w)
                else:  # died while starting: replacing it again would loop forever
                    log.error("a replacement worker exited with code %s while starting; "
                              "the pool shrinks", w.process.exitcode)
                    self._workers.remove(w)
        return True

    def _until_deadline(self) -> float:
        """Seconds until the earliest batch deadline of a worker, LOOK_EVERY at most: the
        loop hands out tasks without waking this thread, so it looks now and then."""
        with self._lock:
            started = self._jobs.first_start_locked(self._workers.workers)
        if started is None:
            return LOOK_EVERY
        left = max(0.0, started + self._jobs.batch_timeout - time.monotonic())
        return min(left, LOOK_EVERY)

    def _expire(self) -> None:
        """Kill and replace each worker whose batch is past batch_timeout_seconds: it hangs
        (a read that never returns, a deadlock in user code); that batch fails, in-band, with
        what the worker was doing, and the client asks again (another server if it has one)."""
        now = time.monotonic()
        timeout = self._jobs.batch_timeout
        for w in list(self._workers.workers):
            with self._lock:
                if not self._jobs.overdue_locked(w, now):
                    continue
                # The task it is on: the first of its jobs, or a later one when it holds the
                # results of those before (see worker_main.HOLD).
                at_task, at_sample = w.progress[0], w.progress[1]
                task = (w.jobs.get(at_task) or next(iter(w.jobs.values()))).task
                self.timeouts += 1
            where = (f"sample {at_sample}" if at_task == task.task_id and at_sample >= 0
                     else "its first sample")
            message = (f"not built within batch_timeout_seconds={timeout:g} "
                       f"(dataset {task.dataset!r}: worker pid {w.process.pid} was at {where});"
                       " the worker was replaced")
            log.error("worker pid %s hangs: a batch of dataset %r was not built within "
                      "batch_timeout_seconds=%g (it was at %s); killing it and starting another",
                      w.process.pid, task.dataset, timeout, where)
            w.process.kill()
            w.process.join(timeout=10)
            self._workers.replace(w, hung=(task.task_id, message))
