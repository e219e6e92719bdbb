"""Batches shared across jobs: one build per batch, however many streams ask for it.

A batch is a pure function of its coordinates and index (docs/design.md), so the streams of
a hyper-parameter sweep (jobs reading one dataset with one seed) can all be served one build
of each batch. A request for (coordinates, batch index) is answered, in this order of
preference, by a batch
- kept from a build a little earlier (`cached`): built batches are kept for
  `cache.shared_seconds`, within `cache.shared_batches` bytes of shared memory (and at most
  1/8 of /dev/shm, and MAX_KEPT batches), oldest dropped first (nearly: see OWNER_SCAN).
  Only coordinates a second stream has asked for get the whole budget; those of one stream
  alone share 1/LONE_SHARE of it (see LONE_SHARE);
- being built for another stream (`joined`): the request waits for that build;
- built for it (`built`).

Sharing is reference counting of the batch's segment: each stream given the batch holds one
reference, the cache one while it keeps it, and the segment goes back to its worker
(WorkerPool.release) when the last is released. A release asking for no reuse (a stream ended
with the segment lent to its client, who may still read it) is remembered and applied then:
the segment is unlinked, not reused; until then it is served as it is (never written again).
A lone job's batch takes the path it took before: built once, one reference, never copied.

A waiter that goes away (its stream closed) drops out; the build is cancelled only once
nobody waits for it. A failed build fails every waiter and is not kept: the next request
builds again.

Threading contract: everything here runs on the server's one asyncio loop; a build's end
reaches it through _on_loop (the pool resolves its futures on the loop too).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import enum
import functools
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from ..order.sampling import Coordinates, EpochKey
from ..pool import shm
from ..pool.messages import FailureKind

if TYPE_CHECKING:
    from .._config import CacheSettings
    from ..pool.layout import BuiltBatch
    from ..pool.workers import WorkerPool
    from .metrics import Metrics

__all__ = ["Outcome", "SharedBatches"]

# The cache takes at most this share of /dev/shm, whatever cache.shared_batches says: the
# workers' segments and the batches streams hold need the rest.
SHM_SHARE = 8
# At most this many batches kept, however small: each holds a segment, which the front end
# keeps mapped (a descriptor each) and the first mapping of a new one checks all the others.
MAX_KEPT = 1024
# A full cache makes room for a new batch by dropping, among its OWNER_SCAN oldest, the oldest
# whose segment belongs to the worker that built the new one: that worker gets a segment back
# for the one it took, and reuses it. Strictly oldest-first hands segments back to workers
# at random: one gets more than it keeps free (unlinked) while another makes new ones, each
# a fresh segment's page faults (measured at 1 MiB batches: 1 batch in 8 built in a new
# segment, a third of the workers' time).
OWNER_SCAN = 16

# Batches of coordinates that only one stream has asked for (a lone job: every job, until
# a sweep's second job asks for the same coordinates) are kept within 1/LONE_SHARE of the
# budget, all such coordinates together. Keeping costs memory that has never been touched:
# each kept batch's worker writes the next one into a new segment (measured here: 1.7 ms of
# CPU for a new 1 MiB segment, 0.08 ms for one reused), so a lone job filling the whole
# budget paid 256 MiB of new segments a server for nobody (lockstep: 2.5-5 ms of the
# servers' CPU a step). A job that comes later than the lone share holds is served from the
# cache from then on: it builds what it missed once, and the first job's builds wait for it.
LONE_SHARE = 16
# Coordinates whose askers are remembered (oldest forgotten first: asked again, they start
# over as one stream's).
MAX_COORDS = 4096


class _Shared:
    """The asker of coordinates that two streams have asked for."""


SHARED = _Shared()

BatchKey = tuple[Coordinates, int]  # coordinates, batch index: all a batch's bytes depend on


class Outcome(enum.Enum):
    """How a request got its batch (the `outcome` label of stoker_shared_batches_total)."""

    BUILT = "built"
    JOINED = "joined"
    CACHED = "cached"


@dataclass
class _Build:
    """A build in flight: the pool's future, and a future per request waiting for it."""

    source: concurrent.futures.Future[BuiltBatch]  # the pool's
    indices: np.ndarray  # the batch's samples
    waiters: list[asyncio.Future[BuiltBatch]]  # resolved by _settle; cancelled: gone


@dataclass
class _Refs:
    """A built batch handed out: how many holders have yet to release it."""

    batch: BuiltBatch
    count: int
    reuse: bool = True  # False once any holder said a client may still read the segment


@dataclass(frozen=True)
class _Kept:
    batch: BuiltBatch
    until: float  # loop time it is dropped at
    nbytes: int  # the shared memory it takes
    owner: int | None  # the pid of the worker whose segment it is


class SharedBatches:
    """The server's builds, shared by every stream; one per server (see the module doc).
    `metrics`: where outcomes and the cache's bytes are counted (None: nowhere);
    `on_built(coords, indices, batch)`: called once per build that succeeded, whoever of
    its waiters is left (the worker's figures are counted there)."""

    def __init__(self, pool: WorkerPool, settings: CacheSettings,
                 metrics: Metrics | None = None,
                 on_built: Callable[[Coordinates, np.ndarray, BuiltBatch], None] | None = None
                 ) -> None:
        self.pool = pool
        self._on_built = on_built
        self._seconds = float(settings.shared_seconds)
        total = shm.capacity()[0]  # 0 where /dev/shm cannot be read
        wanted = int(settings.shared_batches)
        self.budget = min(wanted, total // SHM_SHARE) if total else wanted
        self._metrics = metrics
        if metrics is not None:
            metrics.shared_kept.set_function(lambda: self.kept_bytes)
            metrics.shared_lone.set_function(lambda: self.lone_bytes)
        self._building: dict[BatchKey, _Build] = {}
        self._refs: dict[str, _Refs] = {}  # by segment name
        self._kept: collections.OrderedDict[BatchKey, _Kept] = collections.OrderedDict()
        self.kept_bytes = 0  # of the batches in _kept (oldest first)
        # The first stream to ask for coordinates, or SHARED once another has (MAX_COORDS).
        self._askers: collections.OrderedDict[Coordinates, Hashable] = \
            collections.OrderedDict()
        self._lone: collections.OrderedDict[BatchKey, None] = collections.OrderedDict()
        self.lone_bytes = 0  # of the kept batches in _lone (one stream's coordinates)
        self._timer: asyncio.TimerHandle | None = None  # at the oldest one's time

    async def get(self, coords: Coordinates, index: int, indices: np.ndarray,
                  ahead: np.ndarray, stream: Hashable = None, lane: Hashable = None
                  ) -> tuple[BuiltBatch, Outcome]:
        """Batch `index` of `coords` (its samples `indices`; `ahead`: samples a later batch
        will need, a hint for the workers), held by the caller until it calls release().
        `stream`: who asks (a second stream asking for `coords` gives them the whole
        budget); `lane`: the workers' fair queue's (server/pool/fair_queue.py; default
        `stream`): a build shared is queued in the first asker's.

        Raises BatchFailed (the build failed; every waiter gets it)."""
        key = (coords, index)
        self._asked(coords, stream)
        kept = self._kept.get(key)
        if kept is not None:
            self._refs[kept.batch.shm_name].count += 1
            return kept.batch, self._count(coords, Outcome.CACHED)
        mine: asyncio.Future[BuiltBatch] = asyncio.get_running_loop().create_future()
        build = self._building.get(key)
        if build is not None:
            build.waiters.append(mine)
            outcome = self._count(coords, Outcome.JOINED)
        else:
            source = self.pool.submit(coords.dataset, indices, ahead,
                                      EpochKey(coords.seed, coords.epoch, coords.shuffle),
                                      lane=stream if lane is None else lane)
            build = self._building[key] = _Build(source, indices, [mine])
            _on_loop(source, functools.partial(self._settle, key, build))
            outcome = self._count(coords, Outcome.BUILT)
        try:
            # Each waiter's own future: one going away does not touch the others' build.
            return await mine, outcome
        except asyncio.CancelledError:
            self._leave(key, build, mine)
            raise

    def release(self, batch: BuiltBatch, reuse: bool = True) -> None:
        """One holder is done with `batch`; the last one's release hands its segment back to
        the pool (reuse=False from any holder: unlinked, never reused)."""
        refs = self._refs.get(batch.shm_name)
        if refs is None:  # not handed out here
            self.pool.release(batch, reuse=reuse)
            return
        refs.reuse = refs.reuse and reuse
        refs.count -= 1
        if refs.count <= 0:
            del self._refs[batch.shm_name]
            self.pool.release(batch, reuse=refs.reuse)

    def clear(self) -> None:
        """Drop every kept batch (their memory goes back as soon as no stream holds them)."""
        while self._kept:
            self._drop_oldest()

    # -- builds ----------------------------------------------------------------------------
    def _settle(self, key: BatchKey, build: _Build) -> None:
        """A build ended (on the loop, once): its batch gets one reference per waiter still
        there, plus the cache's, and each waiter its result (or the build's error)."""
        if self._building.get(key) is build:
            del self._building[key]
        source = build.source
        waiting = [w for w in build.waiters if not w.done()]
        if source.cancelled():  # every waiter went away, and the pool dropped the task
            for w in waiting:
                w.cancel()
            return
        error = source.exception()
        if error is not None:
            if getattr(error, "kind", None) is FailureKind.UNAVAILABLE:
                self.clear()  # e.g. /dev/shm is full: new batches need the room more
            for w in waiting:
                w.set_exception(error)
            return
        batch = source.result()
        if self._on_built is not None:
            self._on_built(key[0], build.indices, batch)
        keep = self._fits(batch, self._askers.get(key[0]) is not SHARED)
        count = len(waiting) + keep
        if count == 0:  # built just as the last waiter went away
            self.pool.release(batch)
            return
        self._refs[batch.shm_name] = _Refs(batch, count)
        if keep:
            self._keep(key, batch)
        for w in waiting:
            w.set_result(batch)

    def _leave(self, key: BatchKey, build: _Build, mine: asyncio.Future[BuiltBatch]) -> None:
        """A waiter went away (its stream closed)."""
        if mine.done() and not mine.cancelled():
            # Given its batch (or error) before it could take it: it holds a reference.
            if mine.exception() is None:
                self.release(mine.result())
            return
        build.waiters.remove(mine)
        if not build.waiters:  # nobody wants it: not built if not started yet
            if self._building.get(key) is build:
                del self._building[key]
            build.source.cancel()  # if too late (or done), _settle releases what comes

    def _count(self, coords: Coordinates, outcome: Outcome) -> Outcome:
        """Count a request by how it is answered (as it is decided: a build that fails, or
        that its waiters leave, counts too)."""
        if self._metrics is not None:
            self._metrics.shared_batch(coords.dataset, outcome.value)
        return outcome

    # -- who asks ----------------------------------------------------------------------------
    def _asked(self, coords: Coordinates, stream: Hashable) -> None:
        """`stream` asked for a batch of `coords`: the second stream to do so makes their
        batches the whole budget's (those already kept included)."""
        first = self._askers.get(coords, None)
        if first is None:
            self._askers[coords] = stream
            if len(self._askers) > MAX_COORDS:
                self._askers.popitem(last=False)
        elif first is not SHARED and first != stream:
            self._askers[coords] = SHARED
            for key in [k for k in self._lone if k[0] == coords]:
                del self._lone[key]
                self.lone_bytes -= self._kept[key].nbytes

    @property
    def lone_budget(self) -> int:
        """The bytes kept for coordinates one stream alone has asked for (LONE_SHARE)."""
        return self.budget // LONE_SHARE

    # -- the cache -------------------------------------------------------------------------
    def _fits(self, batch: BuiltBatch, lone: bool) -> bool:
        return 0 < _footprint(batch) <= (self.lone_budget if lone else self.budget)

    def _keep(self, key: BatchKey, batch: BuiltBatch) -> None:
        loop = asyncio.get_running_loop()
        kept = _Kept(batch, loop.time() + self._seconds, _footprint(batch),
                     shm.worker_of(batch.shm_name))
        if key in self._kept:  # built again (its first build lost all its waiters)
            self._drop(key)
        self._kept[key] = kept
        self.kept_bytes += kept.nbytes
        if self._askers.get(key[0]) is not SHARED:
            self._lone[key] = None
            self.lone_bytes += kept.nbytes
            while self.lone_bytes > self.lone_budget:
                self._drop(self._victim(key, kept.owner, self._lone))
        while self.kept_bytes > self.budget or len(self._kept) > MAX_KEPT:
            self._drop(self._victim(key, kept.owner, self._kept))
        if self._timer is None:
            self._timer = loop.call_at(kept.until, self._expire)

    def _drop_oldest(self) -> None:
        self._drop(next(iter(self._kept)))

    def _victim(self, new: BatchKey, owner: int | None,
                among: collections.OrderedDict[BatchKey, _Kept] |
                collections.OrderedDict[BatchKey, None]) -> BatchKey:
        """The batch of `among` (kept ones, oldest first) to drop for room for batch `new`
        (the newest): the oldest of `owner`'s among the OWNER_SCAN oldest, else the oldest."""
        for key in itertools.islice(among, OWNER_SCAN):
            if self._kept[key].owner == owner and key is not new:
                return key
        return next(iter(among))

    def _drop(self, key: BatchKey) -> None:
        """The cache lets go of a batch (its reference released)."""
        kept = self._kept.pop(key)
        self.kept_bytes -= kept.nbytes
        if self._lone.pop(key, SHARED) is None:  # it was one stream's
            self.lone_bytes -= kept.nbytes
        self.release(kept.batch)

    def _expire(self) -> None:
        """Drop the batches past their time; wake again when the next one is."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._kept and next(iter(self._kept.values())).until <= now:
            self._drop_oldest()
        if self._kept:
            self._timer = loop.call_at(next(iter(self._kept.values())).until, self._expire)


def _footprint(batch: BuiltBatch) -> int:
    """The shared memory a batch's segment takes: its payload, rounded up as segments are."""
    return shm.rounded(batch.payload_bytes)


T = TypeVar("T")


def _on_loop(source: concurrent.futures.Future[T], then: Callable[[], None]) -> None:
    """Call `then()` on the running loop once `source` is done: at once when `source` is
    resolved on the loop's own thread, as the pool does (asyncio.wrap_future, and a future
    of the loop per build, cost a write to the loop's wake-up pipe and several callbacks per
    batch even then); through call_soon_threadsafe from another thread (a worker's death
    seen by the dispatcher)."""
    loop = asyncio.get_running_loop()

    def done(_: concurrent.futures.Future[T]) -> None:
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            then()
        else:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(then)

    source.add_done_callback(done)
