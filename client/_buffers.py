"""A pool of reusable host buffers whose reuse waits for the copy that last read them.

Pinned (page-locked) host memory is slow to allocate and scarce, so the device path allocates
a few buffers once and recycles them. A buffer is handed back with the event of the copy that
reads it; acquire() reuses it only once that event has completed. The pool knows nothing of
CUDA: `allocate(nbytes)` makes a buffer, events need only `query()` and `synchronize()`.

Threading: acquire() and release() may be called from different threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")

_MIN_BYTES = 1 << 20


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class BufferPool(Generic[T]):
    def __init__(self, allocate: Callable[[int], T], size_of: Callable[[T], int],
                 max_buffers: int) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        self._allocate = allocate
        self._size_of = size_of
        self._max = max_buffers
        self._free: list[tuple[T, Event | None]] = []  # oldest first
        self._count = 0
        self._lock = threading.Condition()
        self.allocations = 0

    def acquire(self, nbytes: int) -> T:
        """A buffer of at least `nbytes` that no pending copy still reads.

        Blocks while all max_buffers are handed out and not yet released.
        """
        with self._lock:
            while True:
                pick = self._pick(nbytes)
                if pick is not None:
                    buf, event = pick
                    break
                if self._count < self._max:
                    self._count += 1
                    buf, event = None, None
                    break
                if self._free:  # all free buffers too small: replace the oldest
                    _, event = self._free.pop(0)
                    buf = None
                    break
                self._lock.wait()
        if event is not None:
            event.synchronize()  # outside the lock: a copy may take a while
        if buf is None:
            self.allocations += 1
            buf = self._allocate(max(_round_up(nbytes), _MIN_BYTES))
        return buf

    def release(self, buf: T, event: Event | None = None) -> None:
        """Give `buf` back; it is reused once `event` (the copy reading it) has completed."""
        with self._lock:
            self._free.append((buf, event))
            self._lock.notify()

    def _pick(self, nbytes: int) -> tuple[T, Event | None] | None:
        fits = [i for i, (b, _) in enumerate(self._free) if self._size_of(b) >= nbytes]
        # Prefer a buffer whose copy is done; else the oldest that fits (its copy ends first).
        for i in fits:
            ev = self._free[i][1]
            if ev is None or ev.query():
                return self._free.pop(i)[0], None
        return self._free.pop(fits[0]) if fits else None


def _round_up(n: int) -> int:
    """Next power of two: batches of varying size then reuse a few buffer sizes."""
    return 1 << max(n - 1, 0).bit_length()

