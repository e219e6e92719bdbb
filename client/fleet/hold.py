"""Credits held a moment after the loop takes a batch (the loader's schedulers hold them).

Where the loop still has batches in hand beyond the one it took, the credits that take makes
due go out a third of the loop's time between batches later (HOLD_MAX at most), from a
thread of the hold's own, instead of at once. Data-parallel ranks take their batches in the
same instant and meet at the all-reduce right after: a server's answer to a credit (reading
it, ordering its samples, handing the batch to a worker) would take CPU in exactly the
instant every rank needs it, on a host the ranks share with servers or with each other's
loaders. Held, the servers hear of the credits while the model computes. 8 ranks in
lockstep against 2 servers on 2 CPUs: p50 wait a step 4.1-4.7 -> 2.7-3.0 ms, steps/s
+3.5% (benchmarks/lockstep.py; issue 41's note).

A loop with few batches in hand (it may wait soon), or one whose batches come faster than
HOLD_MIN x 3, has its credits sent at once, as ever.

Threading: holds() is called on the loop's thread under the scheduler's lock; the hold's
thread calls `send()` under that lock, and never holds it while it waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

HOLD_MAX = 0.015  # s: at most this long
HOLD_MIN = 0.002  # s: a shorter hold is not worth its thread's wake-up
SLACK = 2  # batches in hand beyond the one taken, for the credits to be held
NEWEST = 0.2  # weight of the latest time between takes in the running estimate


class CreditHold:
    """When the credits of the loop's takes go out."""

    def __init__(self, lock: threading.Condition, send: Callable[[], None]) -> None:
        self._lock, self._send = lock, send  # send() under `lock`: what is due goes out
        self._gap: float | None = None  # the loop's time between takes, smoothed
        self._last: float | None = None
        self._due: float | None = None  # monotonic time the held credits go out
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def holds(self, now: float, in_hand: int) -> bool:
        """Whether the credits of a take at `now` (seconds, the scheduler's clock), with
        `in_hand` batches ready after it, are held: this hold sends them. False: the caller
        sends them now."""
        if self._last is not None:
            gap = now - self._last
            self._gap = gap if self._gap is None else self._gap + NEWEST * (gap - self._gap)
        self._last = now
        hold = min(HOLD_MAX, (self._gap or 0.0) / 3)
        if self._closed or in_hand < SLACK or hold < HOLD_MIN:
            return False
        if self._due is None:  # else credits are held already: they go out together
            self._due = time.monotonic() + hold
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stoker-credit-hold",
                                                daemon=True)
                self._thread.start()
            self._wake.set()
        return True

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            due = self._due
            if due is not None and (delay := due - time.monotonic()) > 0 and not self._closed:
                time.sleep(delay)
            if self._closed:
                return
            with self._lock:
                self._due = None  # a take from now on holds anew
                self._send()
