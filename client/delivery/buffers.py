"""Reusable host buffers: pinned ones whose reuse waits for the device copy that last read
them (BufferPool), and plain ones reused once no batch refers to them (HostBuffers).

Pinned (page-locked) host memory is slow to allocate and scarce, so the device path allocates
a few buffers once and recycles them. A buffer is handed back with the event of the copy that
reads it; acquire() reuses it only once that event has completed. The pool knows nothing of
CUDA: `allocate(nbytes)` makes a buffer, events need only `query()` and `synchronize()`.

Threading: acquire() and release() may be called from different threads.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import numpy as np

T = TypeVar("T")

_MIN_BYTES = 1 << 20


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class BufferPool(Generic[T]):
    """At most `max_buffers` reusable buffers, each handed out again only once nothing reads
    it any more (`release` with the event of a pending copy: acquire waits on it).

    Threading: acquire and release may be called from any thread (one lock guards the pool).

    Example::

        import numpy as np

        pool = BufferPool(lambda n: np.empty(n, np.uint8), lambda b: b.nbytes, max_buffers=2)
        buf = pool.acquire(1 << 20)
        ...  # fill it, use it
        pool.release(buf)

    Args:
        allocate: makes a buffer of the given number of bytes.
        size_of: the bytes a buffer holds.
        max_buffers: the most buffers it allocates and holds (>= 1).

    Raises:
        ValueError: `max_buffers` < 1.

    Attributes:
        allocations: buffers allocated so far.
    """

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

        Args:
            nbytes: the bytes the caller needs.

        Returns:
            A buffer of at least `nbytes` (rounded up to a power of two, at least 1 MiB).
        """
        buf: T | None
        with self._lock:
            while True:
                pick = self._pick(nbytes)
                if pick is not None:
                    buf, event = pick[0], pick[1]
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

    def grow(self, max_buffers: int) -> None:
        """Allow up to `max_buffers` (never fewer than before).

        Args:
            max_buffers: the new most; a smaller number than the present one changes nothing.
        """
        with self._lock:
            self._max = max(self._max, max_buffers)
            self._lock.notify_all()

    def release(self, buf: T, event: Event | None = None) -> None:
        """Give `buf` back; it is reused once `event` (the copy reading it) has completed.

        Args:
            buf: a buffer `acquire` returned.
            event: the event of a copy still reading `buf` (a CUDA event), or None.
        """
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



def _refs_when_free() -> int:
    """sys.getrefcount of a buffer, read as HostBuffers.acquire reads it, when only the pool
    holds it (measured, not assumed: the count differs between Python versions)."""
    bufs = [np.empty(1, np.uint8)]
    return sys.getrefcount(bufs[0])


class HostBuffers:
    """Plain host buffers for batches handed out as numpy arrays or CPU tensors, each reused
    once nothing else refers to it.

    A batch's arrays are numpy views of one buffer (torch.from_numpy keeps the view, and so
    the buffer, alive), so a buffer whose only reference is the pool's holds no batch anyone
    can reach: reusing it overwrites nothing. A batch the caller keeps (a list of batches, a
    tensor saved for later) keeps its buffer out of the pool for as long as it lives.

    Why: a fresh buffer costs a page fault per 4 KiB and the kernel's zeroing on first write.
    glibc serves allocations over 32 MiB with a fresh mmap every time, so every large batch
    paid that (the wire benchmark's client CPU per GB roughly tripled at 64 MiB batches).

    At most `max_buffers` are kept; when all are in use a fresh, unpooled buffer is made.
    Threading: acquire() may be called from several receive threads.
    """

    def __init__(self, max_buffers: int) -> None:
        self._max = max_buffers
        self._bufs: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.allocations = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least `nbytes` (its start is what the batch uses): of the
        free ones that fit, the one handed out last (the list's end is the latest), moved to
        the end again. The loop drops batches in the order they came, so that is the buffer
        freed last, whose bytes are the likeliest still in the CPU's caches: a receive into
        it costs less than into one untouched for a window's worth of batches (measured:
        at 1 MiB batches, a receiver cycling through 34 buffers used 1.5-2x the CPU per GB
        of one reusing a single buffer)."""
        exact = -(-nbytes // _ROUND) * _ROUND  # no pooled buffer that fits is smaller
        with self._lock:
            bufs = self._bufs
            best = small = None
            for i in range(len(bufs) - 1, -1, -1):
                # No local name for the buffer: it would be one more reference.
                if sys.getrefcount(bufs[i]) != _FREE_REFS:
                    continue
                size = bufs[i].nbytes
                if size == exact:  # the best there is: look no further
                    best = i
                    break
                if size >= nbytes:
                    if best is None or size < bufs[best].nbytes:
                        best = i
                elif small is None:
                    small = i
            if best is not None:
                if best != len(bufs) - 1:
                    bufs.append(bufs.pop(best))
                return bufs[-1]
            self.allocations += 1
            fresh = np.empty(exact, np.uint8)
            if small is not None:  # a free buffer too small for this batch: replace it
                del bufs[small]
            if len(bufs) < self._max:
                bufs.append(fresh)
            return fresh

    def grow(self, max_buffers: int) -> None:
        """Keep up to `max_buffers` (never fewer than before)."""
        with self._lock:
            self._max = max(self._max, max_buffers)

    def clear(self) -> None:
        """Drop the pool's references (batches still held by the caller stay valid)."""
        with self._lock:
            self._bufs.clear()


_ROUND = 64 << 10  # sizes grow in these steps, so batches of one shape settle on one size
_FREE_REFS = _refs_when_free()
