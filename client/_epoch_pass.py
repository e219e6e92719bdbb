"""One pass of a loader's loop over the rest of an epoch: `EpochPass`, which owns its
scheduler (kept from the pass before when it asked ahead: fleet/kept.py), its progress bar or
log line, and the stall it reports; `RemoteLoader.__iter__` hands off to it.

Threading: the loop's thread (the loader's); the scheduler it takes batches from is fed by
receive threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import DataMismatch
from ._progress import Progress
from .fleet.policy import group_for

if TYPE_CHECKING:
    from stoker.v1 import stoker_pb2 as pb

    from ._on_demand import OnDemand
    from ._options import LoaderOptions
    from ._stall import Stall
    from .contact.agreement import FingerprintCheck
    from .delivery.buffers import HostBuffers
    from .delivery.sources import SourceCounts
    from .fleet.kept import KeptScheduler
    from .fleet.scheduler import Scheduler
    from .fleet.window import Window
    from .position.place import Place
    from .position.resume import Position

MASK = "attention_mask"  # what pack=True packs by: the datasets' mask of real tokens


@dataclass(frozen=True)
class Loop:
    """What a pass reads and moves of its loader: the loader's parts (each owned by its own
    object) and the loader's public calls it needs, handed over by the loader, so that no
    class reads another's private fields."""

    dataset: str
    options: LoaderOptions
    place: Place
    stats: dict[str, int]  # the loader's counters: "batches" handed out
    kept: KeptScheduler
    agreement: FingerprintCheck
    window: Window
    stall: Stall
    sources: SourceCounts
    host: HostBuffers
    feed: Any  # a DeviceFeed, or None
    normalize: Any  # a Normalizer, or None
    on_demand: OnDemand
    length: Callable[[], int]  # len(loader)
    describe: Callable[[], pb.DescribeDatasetResponse]
    coordinates: Callable[[], pb.Coordinates]
    mismatched: Callable[[DataMismatch], DataMismatch]  # naming both fingerprints


class EpochPass:
    """The batches of `loader`'s current epoch from its position on; iterate once."""

    def __init__(self, loop: Loop) -> None:
        self._loop = loop

    def __iter__(self) -> Iterator[dict[str, Any]]:
        total = self._check()
        if total is None:
            return
        loop, o = self._loop, self._loop.options
        at = loop.place.at
        scheduler = loop.kept.start(at, loop.coordinates(), total, loop.window,
                                       o.timeout)
        # The next epoch's first batches are asked for while this one ends (no drain at the
        # boundary); its size is that of a whole epoch, known once one was described.
        following = loop.on_demand.following(at.epoch + 1) if o.prefetch_next_epoch else None
        if following is not None:
            agreed = loop.agreement.fingerprint
            loop.kept.then(loop.place.coords.message(at.epoch + 1, 0,
                                                     agreed.digest if agreed else ""),
                              following.batches_per_epoch)
        progress = None
        if o.progress or o.log_every is not None:
            progress = Progress(bar=o.progress, log_every=o.log_every, total=total,
                                start=at.next_batch, label=f"{loop.dataset} epoch {at.epoch}")
        serving = scheduler.serving()
        loop.stall.begin(scheduler)
        finished = False
        try:
            yield from self._batches(scheduler, total, progress)
            loop.place.new_epoch()
            finished = True
        finally:
            loop.stall.end()
            if progress is not None:
                progress.close()
            # Not once finished (it asks ahead), nor under a later loop that followed it on.
            if not finished and loop.kept.live is scheduler and \
                    scheduler.serving() is serving:
                loop.kept.drop()

    def _check(self) -> int | None:
        """What must hold before the first batch (the servers' data, normalisation, pack's
        mask); the epoch's batches, or None when the rest of a resumed epoch has none here."""
        loop = self._loop
        total = loop.length()  # ValueError for an epoch without a batch
        if not loop.agreement.checked:
            loop.agreement.check_servers(loop.place.coords.message(loop.place.at.epoch),
                                            loop.window.cap_credits)
        fields = loop.describe().fields
        if loop.normalize is not None and not loop.normalize.axes:
            loop.normalize.validate(fields)  # here, not on a receive thread
        if loop.options.pack and MASK not in {f.name for f in fields}:
            raise ValueError(f"pack=True packs the tokens {MASK!r} marks, but dataset "
                             f"{loop.dataset!r} has no {MASK} (its fields: "
                             f"{sorted(f.name for f in fields)}): give it a "
                             "length_column that is a list (docs/client.md#token-budgets)")
        # finished (saved on an epoch's last batch)
        if loop.place.at.next_batch and loop.place.at.next_batch >= total:
            loop.place.new_epoch()
            return loop.length()
        if not total:  # the rest of a resumed epoch has no batch here: it is over
            loop.place.new_epoch()
            return None
        return total

    def _batches(self, scheduler: Scheduler, total: int, progress: Progress | None
                 ) -> Iterator[dict[str, Any]]:
        loop, stall, window = self._loop, self._loop.stall, self._loop.window
        while loop.place.at.next_batch < total:
            at, t0 = loop.place.at, time.perf_counter()
            try:
                def on_wait(t0: float = t0, at: Position = at) -> None:
                    stall.waiting(scheduler, t0, at.epoch, at.next_batch)

                batch = scheduler.take(at.next_batch, on_wait=on_wait)
            except DataMismatch as e:  # a server refused our fingerprint: name both
                raise loop.mismatched(e) from None
            loop.agreement.look(first_batch=not loop.stats["batches"])  # others' data
            waited = time.perf_counter() - t0
            stall.wait_seconds += waited
            if window.adapts or not window.sized:
                self._resize_window(scheduler)
            batch = loop.on_demand.handed(batch, loop.feed)
            loop.sources.handed_out(at.epoch, at.next_batch)
            loop.place.next_batch()
            loop.stats["batches"] += 1
            if progress is not None:
                progress.step(at.next_batch, waited, scheduler.received())
            stall.due(scheduler, None)
            yield batch

    def _resize_window(self, scheduler: Scheduler) -> None:
        """Once the first batch's size is known, the window may widen for small batches
        (Window.fit); an adapting one follows the fleet and the loop's stall (Window.adapt).
        The buffer pools grow to match, and the streams' credits follow."""
        loop = self._loop
        w, looped = loop.window, loop.stall.loop_seconds()
        size = None if w.sized else w.fit(loop.options.prefetch_bytes or 0)
        if w.due(looped):  # else adapt() would not look: the fleet's figures are not taken
            described = loop.describe()
            rows = described.samples_per_rank / max(described.batches_per_epoch, 1)
            size = w.adapt(scheduler.fleet(), rows, loop.stall.wait_seconds, looped,
                           loop.stats["batches"]) or size
        if size is not None:
            loop.host.grow(size + 2)
            if loop.feed is not None:
                loop.feed.pool.grow(size + 2)
            scheduler.resize(size, group_for(size) if w.widened else 1)
        scheduler.window_note = w.note()
