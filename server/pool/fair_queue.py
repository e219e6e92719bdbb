"""The jobs waiting for a worker, served fairly between the lanes that asked for them.

A lane is who asks (server/front/credits.py names them: one client connection's reading of one
dataset under one set of coordinates, whatever its epoch). Each lane's jobs go in the order
they came. Across lanes, the job with the lowest tag goes first: a lane's next job is tagged
one past its previous one, but never below the tag of the job served last (start-time fair
queueing, equal weights). A burst of one lane's credits (a stream that starts, or whose
client widened its window) then waits its turn behind the other lanes' next batches instead
of ahead of all of them: 8 ranks in lockstep credited 22 batches each at start, and in
arrival order the last rank's first batch came 154 batches later. Jobs put back (their worker
died) go before every other. A batch's parts share one tag, in part order.

Not thread-safe: guarded by the pool's lock, like the rest of an Assignment.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")

# Lanes whose last tag fell behind are forgotten once this many are remembered: their next
# job is tagged from the present anyway.
REMEMBER = 1024


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, T]] = []  # (tag, arrival, job)
        self._arrivals = itertools.count()
        self._last: dict[Hashable, int] = {}  # lane -> the tag of its latest job
        self._now = 0  # the tag of the job served last

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[T]:
        """The jobs in the order they would be served."""
        return (job for _, _, job in sorted(self._heap, key=lambda e: e[:2]))

    def add(self, jobs: Iterable[T], lane: Hashable = None) -> None:
        """A batch of `lane` (its one task, or its parts in order): one tag."""
        tag = max(self._now, self._last.get(lane, self._now)) + 1
        self._last[lane] = tag
        for job in jobs:
            heapq.heappush(self._heap, (tag, next(self._arrivals), job))

    def put_back(self, jobs: Iterable[T]) -> None:
        """Jobs to serve before any other, in this order."""
        front = min(self._now, self._heap[0][0] if self._heap else self._now) - 1
        for job in jobs:
            heapq.heappush(self._heap, (front, next(self._arrivals), job))

    def pop(self) -> T:
        """The next job (IndexError when none)."""
        tag, _, job = heapq.heappop(self._heap)
        self._now = max(self._now, tag)
        if len(self._last) > REMEMBER:
            self._last = {s: t for s, t in self._last.items() if t > self._now}
        return job

    def clear(self) -> list[T]:
        """Empty it; the jobs it held, in serving order."""
        jobs = list(self)
        self._heap.clear()
        return jobs
