"""One pass of a loader's loop over the rest of an epoch: `EpochPass`, which owns its
scheduler (kept from the pass before when it asked ahead: fleet/kept.py), its progress bar or
log line, and the stall it reports; `RemoteLoader.__iter__` hands off to it.

Threading: the loop's thread (the loader's); the scheduler it takes batches from is fed by
receive threads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

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


class Loop(Protocol):
    """What a pass reads and moves of its loader (RemoteLoader is one; a type checker holds
    it to this where it hands itself over), named here so that this module need not import
    the loader's."""

    dataset: str
    _options: LoaderOptions
    _place: Place
    _stats: dict[str, int]
    _kept: KeptScheduler
    _agreement: FingerprintCheck
    _window: Window
    _stall: Stall
    _sources: SourceCounts
    _host: HostBuffers
    _feed: Any  # a DeviceFeed, or None
    _normalize: Any  # a Normalizer, or None
    _on_demand: OnDemand

    def __len__(self) -> int: ...
    def describe(self) -> pb.DescribeDatasetResponse: ...
    def coordinates(self) -> pb.Coordinates: ...
    def _mismatched(self, err: DataMismatch) -> DataMismatch: ...


class EpochPass:
    """The batches of `loader`'s current epoch from its position on; iterate once."""

    def __init__(self, loader: Loop) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        total = self._check()
        if total is None:
            return
        loader, o = self._loader, self._loader._options
        at = loader._place.at
        scheduler = loader._kept.start(at, loader.coordinates(), total, loader._window,
                                       o.timeout)
        # The next epoch's first batches are asked for while this one ends (no drain at the
        # boundary); its size is that of a whole epoch, known once one was described.
        following = loader._on_demand._following(at.epoch + 1) if o.prefetch_next_epoch else None
        if following is not None:
            agreed = loader._agreement.fingerprint
            loader._kept.then(loader._place.coords.message(at.epoch + 1, 0,
                                                     agreed.digest if agreed else ""),
                              following.batches_per_epoch)
        progress = None
        if o.progress or o.log_every is not None:
            progress = Progress(bar=o.progress, log_every=o.log_every, total=total,
                                start=at.next_batch, label=f"{loader.dataset} epoch {at.epoch}")
        serving = scheduler.serving()
        loader._stall.begin(scheduler)
        finished = False
        try:
            yield from self._batches(scheduler, total, progress)
            loader._place.new_epoch()
            finished = True
        finally:
            loader._stall.end()
            if progress is not None:
                progress.close()
            # Not once finished (it asks ahead), nor under a later loop that followed it on.
            if not finished and loader._kept.live is scheduler and \
                    scheduler.serving() is serving:
                loader._kept.drop()

    def _check(self) -> int | None:
        """What must hold before the first batch (the servers' data, normalisation, pack's
        mask); the epoch's batches, or None when the rest of a resumed epoch has none here."""
        loader = self._loader
        total = len(loader)  # ValueError for an epoch without a batch
        if not loader._agreement.checked:
            loader._agreement.check_servers(loader._place.coords.message(loader._place.at.epoch),
                                            loader._window.cap_credits)
        fields = loader.describe().fields
        if loader._normalize is not None and not loader._normalize.axes:
            loader._normalize.validate(fields)  # here, not on a receive thread
        if loader._options.pack and MASK not in {f.name for f in fields}:
            raise ValueError(f"pack=True packs the tokens {MASK!r} marks, but dataset "
                             f"{loader.dataset!r} has no {MASK} (its fields: "
                             f"{sorted(f.name for f in fields)}): give it a "
                             "length_column that is a list (docs/client.md#token-budgets)")
        # finished (saved on an epoch's last batch)
        if loader._place.at.next_batch and loader._place.at.next_batch >= total:
            loader._place.new_epoch()
            return len(loader)
        if not total:  # the rest of a resumed epoch has no batch here: it is over
            loader._place.new_epoch()
            return None
        return total

    def _batches(self, scheduler: Scheduler, total: int, progress: Progress | None
                 ) -> Iterator[dict[str, Any]]:
        loader, stall, window = self._loader, self._loader._stall, self._loader._window
        while loader._place.at.next_batch < total:
            at, t0 = loader._place.at, time.perf_counter()
            try:
                def on_wait(t0: float = t0, at: Position = at) -> None:
                    stall.waiting(scheduler, t0, at.epoch, at.next_batch)

                batch = scheduler.take(at.next_batch, on_wait=on_wait)
            except DataMismatch as e:  # a server refused our fingerprint: name both
                raise loader._mismatched(e) from None
            loader._agreement.look(first_batch=not loader._stats["batches"])  # others' data
            waited = time.perf_counter() - t0
            stall.wait_seconds += waited
            if window.adapts or not window.sized:
                self._resize_window(scheduler)
            batch = loader._on_demand._handed(batch, loader._feed)
            loader._sources.handed_out(at.epoch, at.next_batch)
            loader._place.next_batch()
            loader._stats["batches"] += 1
            if progress is not None:
                progress.step(at.next_batch, waited, scheduler.received())
            stall.due(scheduler, None)
            yield batch

    def _resize_window(self, scheduler: Scheduler) -> None:
        """Once the first batch's size is known, the window may widen for small batches
        (Window.fit); an adapting one follows the fleet and the loop's stall (Window.adapt).
        The buffer pools grow to match, and the streams' credits follow."""
        loader = self._loader
        w, loop = loader._window, loader._stall.loop_seconds()
        size = None if w.sized else w.fit(loader._options.prefetch_bytes or 0)
        if w.due(loop):  # else adapt() would not look: the fleet's figures are not taken
            described = loader.describe()
            rows = described.samples_per_rank / max(described.batches_per_epoch, 1)
            size = w.adapt(scheduler.fleet(), rows, loader._stall.wait_seconds, loop,
                           loader._stats["batches"]) or size
        if size is not None:
            loader._host.grow(size + 2)
            if loader._feed is not None:
                loader._feed.pool.grow(size + 2)
            scheduler.resize(size, group_for(size) if w.widened else 1)
        scheduler.window_note = w.note()
