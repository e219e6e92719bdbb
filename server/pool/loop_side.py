"""The event loop's share of the pool: it reads each ready worker's results (loop.add_reader)
and hands out the tasks submitted on it, in the thread that submits them.

A batch so crosses no thread: no wake-up pipe, no hop back to the loop (at 64 KiB batches the
dispatcher thread's hops cost about a third of the front end's time per batch, and each one
contended for the GIL with the loop).

Threading: a worker's pipe is read by one thread at a time: the dispatcher's until the worker
is ready, the loop's from hand_over() on, and the dispatcher's (or close()'s) again once
take_back() returns. hand_over() sets `w.on_loop` before the loop's first read; the loop clears
it after its last. `loop` is set once, by attach(), before any pipe is handed over; the other
fields of a LoopSide are the loop thread's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import threading
from collections.abc import Callable
from typing import Any

from .handle import WorkerHandle

log = logging.getLogger("stoker.server")

# Seconds a segment given back waits for the next task to ride along with to its worker,
# before it goes alone (the end of an epoch): one pipe write per batch instead of two.
GIVE_BACK_WAIT = 0.02
# Seconds a thread waits for the loop to let go of a worker's pipe (see take_back).
UNWATCH_WAIT = 5.0

# What the loop does with one pipe message of a worker (a result, or a tuple of them).
Settle = Callable[[WorkerHandle, Any], None]


class LoopSide:
    """Reads ready workers' pipes on the loop, and hands out tasks there; `assign(flush)`:
    the pool's hand-out of queued tasks (and segments given back; see WorkerPool._assign)."""

    def __init__(self, assign: Callable[[bool], None]) -> None:
        self._assign = assign
        self.loop: asyncio.AbstractEventLoop | None = None  # batches flow on it
        self._give_back: asyncio.TimerHandle | None = None  # a flush, pending
        self._assign_soon = False  # an assign of the tasks submitted is scheduled

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the loop batches flow on: it hands out tasks itself."""
        if self.loop is None:
            return False
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    # -- handing out, on the loop ----------------------------------------------------------
    def assign_soon(self) -> None:
        """On the loop, after a submit: hand out once this turn of the loop is over, so that
        the batches of a credit record, submitted in the same turn, go in one pipe write per
        worker."""
        if self._assign_soon:
            return
        self._assign_soon = True
        assert self.loop is not None
        self.loop.call_soon(self._assign_submitted)

    def _assign_submitted(self) -> None:
        self._assign_soon = False
        self._assign(False)

    def flush_later(self) -> None:
        """On the loop, after a release: the segment goes with the next task (a batch's
        credit is usually on its way), or alone once GIVE_BACK_WAIT passes without one."""
        if self._give_back is not None:
            return
        assert self.loop is not None
        self._give_back = self.loop.call_later(GIVE_BACK_WAIT, self._flush)

    def _flush(self) -> None:
        """The segments given back that no task took along, alone."""
        self._give_back = None
        self._assign(True)

    # -- the pipes -------------------------------------------------------------------------
    def hand_over(self, w: WorkerHandle, settle: Settle) -> None:
        """A ready worker's pipe goes to the loop, which passes what it reads to `settle`
        (from the thread that read it so far, which reads it no more: the dispatcher leaves
        it out of its next wait)."""
        assert self.loop is not None
        w.poller = select.poll()
        w.poller.register(w.conn.fileno(), select.POLLIN)
        w.on_loop = True
        try:
            self.loop.call_soon_threadsafe(self._watch, w, settle)
        except RuntimeError:  # the loop has closed: nobody submits any more
            w.on_loop = False

    def _watch(self, w: WorkerHandle, settle: Settle) -> None:
        """On the loop: read `w`'s results as they come (unless it was taken back since)."""
        if w.on_loop:
            assert self.loop is not None
            self.loop.add_reader(w.conn.fileno(), self._on_readable, w, settle)

    def _on_readable(self, w: WorkerHandle, settle: Settle) -> None:
        """On the loop: settle what `w` has sent, then hand out tasks (it has room now)."""
        got = False
        try:
            while w.poller.poll(0):
                settle(w, w.conn.recv())
                got = True
        except (EOFError, OSError):  # it died: the dispatcher's wait sees its sentinel
            self._stop_reading(w)
        if got:
            self._assign(False)

    def _stop_reading(self, w: WorkerHandle) -> None:
        assert self.loop is not None
        with contextlib.suppress(ValueError, OSError, RuntimeError):  # closed pipe, or loop
            self.loop.remove_reader(w.conn.fileno())

    def take_back(self, w: WorkerHandle) -> None:
        """Take `w`'s pipe back from the loop (any thread but the loop's waits until the loop
        has let go of it); the caller may read it from then on."""
        if not w.on_loop:
            return
        assert self.loop is not None

        def let_go() -> None:
            w.on_loop = False
            self._stop_reading(w)

        if self.on_loop_thread():
            let_go()
            return
        done = threading.Event()

        def on_loop() -> None:
            try:
                let_go()
            finally:
                done.set()

        try:
            self.loop.call_soon_threadsafe(on_loop)
        except RuntimeError:  # the loop has closed: it reads nothing any more
            w.on_loop = False
            return
        if not done.wait(UNWATCH_WAIT):  # the loop is stopped, or stuck: it reads nothing
            log.warning("the event loop did not let go of worker pid %s's pipe within %.0f s",
                        w.process.pid, UNWATCH_WAIT)
            w.on_loop = False
