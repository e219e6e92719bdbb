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

The take does not wake the hold's thread: a wake-up from the loop's thread is a system call
and a thread switch in the very instant the hold is for (on the 2-core VM a futex wake costs
about 40 us of CPU, and the woken thread then waits for the GIL the loop holds). The thread
paces itself instead: it looks again when the next take's credits would be due (the last
take + the time between takes + the hold), sleeps on to the due time if the take is late,
and only after PAUSE x that time without a held take waits to be woken (a loop that paused:
the next take that holds wakes it).

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
PAUSE = 3  # looks without a held take (each a take's time apart) before waiting to be woken


class CreditHold:
    """When the credits of the loop's takes go out."""

    def __init__(self, lock: threading.Condition, send: Callable[[], None]) -> None:
        self._lock, self._send = lock, send  # send() under `lock`: what is due goes out
        self._gap: float | None = None  # the loop's time between takes, smoothed
        self._last: float | None = None
        self._taken = 0.0  # time.monotonic() of the last take (the thread's clock)
        self._due: float | None = None  # monotonic time the held credits go out
        self._wake = threading.Event()
        self._asleep = True  # the thread waits to be woken (not pacing itself)
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
        self._taken = time.monotonic()
        hold = min(HOLD_MAX, (self._gap or 0.0) / 3)
        if self._closed or in_hand < SLACK or hold < HOLD_MIN:
            return False
        if self._due is None:  # else credits are held already: they go out together
            self._due = time.monotonic() + hold
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stoker-credit-hold",
                                                daemon=True)
                self._thread.start()
            if self._asleep:  # else it looks by itself about now + hold
                self._asleep = False
                self._wake.set()
        return True

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        idle = 0  # looks in a row that found nothing held
        while not self._closed:
            with self._lock:
                due, gap, taken = self._due, self._gap or HOLD_MAX, self._taken
                if due is None and idle >= PAUSE:
                    self._asleep = True
            if due is None and idle >= PAUSE:
                self._nap(None)  # until a take holds (or close)
                idle = 0
                continue
            now = time.monotonic()
            if due is None:  # the next take's credits: due a take's time + the hold on
                idle += 1
                expected = taken + gap + min(HOLD_MAX, gap / 3)
                self._nap(max(expected - now, gap / 4))  # later: it is late
                continue
            idle = 0
            if due > now:
                self._nap(due - now)
                continue  # looked again: the due time stands until it is sent
            with self._lock:
                if not self._closed:
                    self._due = None  # a take from now on holds anew
                    self._send()

    def _nap(self, seconds: float | None) -> None:
        """Wait `seconds` (None: until woken); a wake (close, or a take that found this
        thread asleep) ends it, and is used up."""
        if self._wake.wait(seconds):
            self._wake.clear()
