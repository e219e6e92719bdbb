"""Batches built in parts: one batch cut into row ranges that several workers build at once
into one shared-memory segment of the pool's own, so that a batch takes a part's time, not
batch_size samples' time on one worker (a rank's rate is its window over one batch's latency).

A batch is cut only where its layout is known before any sample is read: every field the
probe found (DatasetMeta.fields) has a fixed shape, so a batch of n samples is laid out as
build_batch lays out one whose samples all match sample 0's fields (batch.planned_layout).
Each worker writes its rows and their delivered sample indices; the bytes are those of a
one-worker build. Whatever a part cannot plan for goes back to that build, whole, on one
worker, which gives its exact bytes or its exact error: a sample unlike the plan (a Misfit),
files changed since the listing, padded fields, a layout over max_batch_bytes, no room in
/dev/shm for the pool's segment. Of several parts that fail, the batch fails with the error
of the lowest (what a sequential build meets first). A part whose worker dies is sent again
(RESENDS times); one whose worker hangs fails its batch, as a hung batch does.

Threading: a Splitter and each Assembly are guarded by the pool's lock (see assign.py);
OwnSegments has a lock of its own, taken after the pool's where both are held.
"""

from __future__ import annotations

import concurrent.futures
import enum
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from . import shm
from .batch import planned_layout
from .depth import KEEP_BYTES, KEEP_MIN, KEEP_SEGMENTS
from .layout import BuiltBatch, TensorLayout
from .messages import BatchFailed, Part, PartBuilt, Task

# Samples per part at least: a part costs two pipe messages and a wake-up of each side.
MIN_ROWS = 8
# Work per part aimed at: a few ms, so that a batch's latency is a few parts' time at most,
# and parts spread over every worker while the messages stay a small share of it.
PART_SECONDS = 0.005
# A batch is cut over the workers that would otherwise idle (parts of PART_SECONDS); beyond
# those, into parts of at least this much work. Built whole by one worker, a batch costs its
# stream batch_size samples' time of latency, and a rank's rate is its window over that
# latency (docs/design.md, Little's law): one rank's default window (12 batches against 2
# servers x 8 workers) kept at most that many workers busy on batches of 256 x 2 ms (0.5 s
# whole): 0.73 of their capacity, and the batch the loop awaited outlived the client's
# hedging patience (0.5 s) and was built twice (issue 49). Parts of 0.1 s let one batch in
# flight keep 5 workers busy, and leave lockstep's quick batches (32 x 2 ms) whole unless
# workers idle, even measured 3 times slower: a part costs the front end and a worker
# messages, wake-ups and a mapping (4 parts doubled both sides' CPU a 1 MiB batch), which
# buy a busy pool nothing where the window hides a whole batch.
BUSY_PART_SECONDS = 0.1
# A batch measured cheaper than this, whole, is one part (a plain Task, as before splitting):
# 64 KiB batches of 16 samples cost mostly their messages.
CHEAP_SECONDS = 0.002
# A batch built faster than this many bytes a second by one worker is one part too: its cost
# is its bytes (arrays copied, not decoded), and cut into parts it costs the front end a
# segment of its own and each worker a mapping of it, for no gain in latency worth it (the
# window keeps every worker busy): 16 and 64 MiB batches of memcpy-cheap samples, cut, went
# from about 0.85 to 0.5 of a raw TCP stream on the wire benchmark. Decoded images, and the
# samples that stand for them, build at tens of MB/s.
BOUND_BY_BYTES = 500 << 20
# Times a part whose worker died is sent to another before its batch fails.
RESENDS = 1
# Weight of the latest measurement in the running estimate of seconds per sample.
NEWEST = 0.2
# A dataset whose split batches keep falling back to one worker stops being split: after
# MISFITS_MIN fallbacks, once they are more than a quarter of its split batches.
MISFITS_MIN = 8


@dataclass(frozen=True)
class Plan:
    layout: tuple[TensorLayout, ...]
    size: int  # payload bytes
    parts: int


def parts_for(n: int, per_sample: float | None, workers: int) -> int:
    """How many parts a batch of `n` samples is cut into: parts of about PART_SECONDS of work
    (`per_sample`: measured seconds per sample; None: not measured yet, as many as may be),
    MIN_ROWS samples each at least, one per worker at most; a batch cheaper than
    CHEAP_SECONDS whole stays one."""
    most = min(workers, n // MIN_ROWS)
    if most <= 1:
        return 1
    if per_sample is None:
        return most
    whole = n * per_sample
    if whole < CHEAP_SECONDS:
        return 1
    return max(1, min(most, round(whole / PART_SECONDS)))


def workers_for(n: int, per_sample: float | None, idle: int, ready: int) -> int:
    """The workers a batch of `n` samples may be cut over: the `idle` ones (those that would
    otherwise have nothing to build), or, if more, as many of the `ready` ones as its whole
    build (`per_sample`: measured seconds per sample; None: not yet) has parts of
    BUSY_PART_SECONDS or more."""
    if per_sample is None:
        return idle
    return max(idle, min(ready, int(n * per_sample / BUSY_PART_SECONDS)))


class Splitter:
    """Which batches are cut into parts, and into how many (guarded by the pool's lock)."""

    def __init__(self, fields: dict[str, list[tuple[str, str, tuple[int, ...]]]],
                 max_bytes: int) -> None:
        # Per dataset whose batches can be laid out before any sample is read, its fields.
        self._fields = {name: f for name, f in fields.items()
                        if planned_layout(f, 1) is not None}
        self._max_bytes = max_bytes
        self._per_sample: dict[str, float] = {}  # seconds of a worker per sample, measured
        self._split: dict[str, int] = {}
        self._misfits: dict[str, int] = {}
        self.per_sample = 0.0  # over every dataset: what capacity() reports (0: none yet)

    def add_locked(self, dataset: str, fields: list[tuple[str, str, tuple[int, ...]]]) -> None:
        """A dataset opened after start (a lake table's snapshot): cut like the others."""
        if planned_layout(fields, 1) is not None:
            self._fields[dataset] = fields

    def plan_locked(self, dataset: str, n: int, workers: Callable[[], tuple[int, int]]
                    ) -> Plan | None:
        """How to cut a batch of `n` samples of `dataset`, `workers()` being (the workers
        that would otherwise idle, the workers ready); None: built whole by one worker. Per
        batch submitted, on the front end's thread: the usual answers for small batches come
        first, cheaply."""
        per_sample = self._per_sample.get(dataset)
        if (n < 2 * MIN_ROWS or dataset not in self._fields
                or (per_sample is not None and n * per_sample < CHEAP_SECONDS)):
            return None
        parts = parts_for(n, per_sample, workers_for(n, per_sample, *workers()))
        if parts <= 1 or self._misfits.get(dataset, 0) * 4 > max(
                self._split.get(dataset, 0), MISFITS_MIN * 4 - 1):
            return None
        layout = planned_layout(self._fields[dataset], n)
        assert layout is not None
        size = layout[-1].offset + layout[-1].nbytes
        if size > self._max_bytes:
            return None  # the one-worker build says so, as it always has
        if per_sample is not None and size > BOUND_BY_BYTES * n * per_sample:
            return None  # built at memory speed: bytes, not work
        self._split[dataset] = self._split.get(dataset, 0) + 1
        return Plan(layout, size, parts)

    def measured_locked(self, dataset: str, seconds: float, samples: int) -> None:
        """A worker took `seconds` for `samples` samples of `dataset` (a batch, or a part)."""
        if samples <= 0:
            return
        now = seconds / samples
        was = self._per_sample.get(dataset)
        self._per_sample[dataset] = now if was is None else was + NEWEST * (now - was)
        self.per_sample = now if not self.per_sample else (
            self.per_sample + NEWEST * (now - self.per_sample))

    def misfit_locked(self, dataset: str) -> None:
        self._misfits[dataset] = self._misfits.get(dataset, 0) + 1


class Verdict(enum.Enum):
    """What becomes of a batch once all its parts are in."""

    BUILT = "built"  # its future gets the batch
    FAILED = "failed"  # its future gets the lowest part's error
    WHOLE = "whole"  # built again by one worker: a part could not follow the plan
    DROPPED = "dropped"  # nobody waits for it: its segment goes back


# What a part came to: its rows written (PartBuilt), an error (BatchFailed), MISFIT (the
# batch goes whole), or None (dropped unsent: nobody waits for its batch).
MISFIT = "misfit"


@dataclass(eq=False)
class Assembly:
    """One batch being built in parts into `segment` (guarded by the pool's lock)."""

    whole: Task  # the batch as one worker would build it: the fallback
    future: concurrent.futures.Future[BuiltBatch]
    segment: str
    plan: Plan
    left: int = 0  # parts not yet in
    # part -> what it came to
    outcomes: dict[int, PartBuilt | BatchFailed | str | None] = field(default_factory=dict)
    resent: dict[int, int] = field(default_factory=dict)  # part -> times sent again

    def cut(self, first_id: int) -> list[Part]:
        """The parts, task ids from `first_id` on; rows (and the hint `ahead`) in equal
        shares, in order."""
        n, p, t = len(self.whole.indices), self.plan.parts, self.whole
        rows = [n * k // p for k in range(p + 1)]
        ahead = [len(t.ahead) * k // p for k in range(p + 1)]
        self.left = p
        return [Part(first_id + k, t.dataset, self.segment, self.plan.size, self.plan.layout,
                     rows[k], t.indices[rows[k]:rows[k + 1]], t.ahead[ahead[k]:ahead[k + 1]],
                     t.key) for k in range(p)]

    def settle_locked(self, part: int, outcome: PartBuilt | BatchFailed | str | None
                      ) -> Verdict | None:
        """Part `part` is in; what becomes of the batch, once all are (else None)."""
        if part in self.outcomes:
            return None  # settled already (a result that crossed a resend)
        self.outcomes[part] = outcome
        self.left -= 1
        if self.left:
            return None
        if self.future.done():
            return Verdict.DROPPED
        worst = min((k for k, o in self.outcomes.items() if not isinstance(o, PartBuilt)),
                    default=None)
        if worst is None:
            return Verdict.BUILT
        return Verdict.WHOLE if self.outcomes[worst] == MISFIT else Verdict.FAILED

    def error(self) -> BatchFailed:
        """The lowest failed part's error (Verdict.FAILED)."""
        return next(o for k in sorted(self.outcomes)
                    if isinstance(o := self.outcomes[k], BatchFailed))

    def batch(self) -> BuiltBatch:
        """The batch, once every part was built (Verdict.BUILT)."""
        built = [o for o in self.outcomes.values() if isinstance(o, PartBuilt)]
        return BuiltBatch(self.segment, self.plan.size, self.plan.layout,
                          len(self.whole.indices), sum(o.skipped for o in built),
                          sum(o.seconds for o in built))


class OwnSegments:
    """The pool's own segments, which parts of batches are written into: a SegmentPool in
    the front-end process, named under the server's prefix (sweeps find them) and reused
    (no page faults once warm). It keeps as many idle as the workers' pools would, whose
    segments such batches leave idle. Any thread (a lock of its own)."""

    PREFIX = "pool_"

    def __init__(self, workers: int) -> None:
        self._lock = threading.Lock()
        self._prefix = shm.prefix(os.getpid()) + self.PREFIX
        self._pool = shm.SegmentPool(self._prefix, KEEP_SEGMENTS * workers,
                                     KEEP_MIN * workers, KEEP_BYTES * workers)

    def owns(self, name: str) -> bool:
        return name.startswith(self._prefix)

    def acquire(self, size: int) -> str:
        """A segment of at least `size` bytes, lent until given back. Raises shm.ShmFull."""
        with self._lock:
            name, _ = self._pool.acquire(size)
        return name

    def give_back(self, name: str) -> None:
        with self._lock:
            self._pool.give_back(name)

    def discard(self, name: str) -> None:
        """A client may still read it: unlinked, never written again."""
        with self._lock:
            self._pool.discard(name)
