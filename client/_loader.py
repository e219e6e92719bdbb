"""RemoteLoader: iterate over batches that data servers compute.

Threading: a RemoteLoader is used from one thread (the training loop). Behind it, one receive
thread per stream assembles batches, so at most `prefetch` batches wait in host memory.
"""

from __future__ import annotations

import collections
import logging
import operator
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from stoker.v1 import stoker_pb2 as pb

from . import _samehost as samehost
from ._buffers import HostBuffers
from ._contact import first_contact
from ._datalink import Transports
from ._errors import DataMismatch, RemoteError
from ._frames import Assembled, numpy_views
from ._log import say
from ._options import LoaderOptions, default_rank_world, prefetching
from ._pinning import Pin, describe_each, mismatch, short
from ._progress import Progress
from ._scheduler import FATAL, Scheduler, group_for
from ._servers import RESOLVE_EVERY, Resolver, ServerSet
from ._sizes import MAX_CREDITS, check_epoch, credit_window, say_dropped
from ._stream import StreamSpec
from .channel import ChannelMaker

_MISSING = object()

# state_dict()["coordinates"] keys that may differ between the loader that saved a state and
# the one that loads it (an elastic resume): the rest of the epoch's order is re-partitioned.
# Every other key (dataset, seed, shuffle, drop_last) fixes the order or its tail: equal.
ELASTIC = ("rank", "world_size", "batch_size", "start")

# The loop's data stall goes to the servers (for their metrics) every REPORT_EVERY seconds of
# iterating, the first time after REPORT_FIRST, by the clock: from the wait for a batch too
# (a loop stuck waiting is the stall an autoscaler must see), and at the start of each pass
# (a new stream) once there is something to say, so that short epochs report too.
REPORT_FIRST, REPORT_EVERY = 1.0, 5.0
# A report covers the loop's last REPORT_WINDOW to REPORT_WINDOW + REPORT_EVERY seconds (all
# of it while it is younger), not the time since the loader began: a stall that added servers
# ended must leave the servers' gauge within a window, or an autoscaler keeps adding more.
REPORT_WINDOW = 10.0
SAY_WAITING = 3.0  # seconds the loop waits for one batch before an INFO line says why
MASK = "attention_mask"  # what pack=True packs by: the datasets' mask of real tokens


class RemoteLoader:
    """Batches of `dataset` from a stoker data server, as dicts of tensors (or numpy arrays).

    Each batch holds every field of the dataset, collated, plus `sample_index` (int64): the
    dataset index of each sample. The sequence is a pure function of (dataset, seed, epoch,
    shuffle, rank, world_size, batch_size, drop_last): any server gives the same batches.

    Epochs: iterating yields the rest of the current epoch, from where the last iteration
    stopped; once an epoch is finished the loader moves on to the next (a new shuffle order),
    so `for batch in loader` twice gives two epochs, as with DataLoader(shuffle=True).
    `set_epoch(e)` selects an epoch explicitly, as with DistributedSampler. `state_dict()`
    records the position; `load_state_dict()` resumes there, also at another world_size or
    batch_size (the rest of the epoch's order, re-partitioned: docs/client.md#resuming).

    Data: the loader pins the dataset's fingerprint from the first server that describes it
    and reads only from servers that have the same (DataMismatch otherwise, naming both); a
    state_dict records it, and resuming against other data is refused unless asked for.
    """

    def __init__(self, address: str | Sequence[str], dataset: str,
                 batch_size: int | None = None, *, batch_tokens: int | None = None,
                 token_cost: str = "tokens", pack: bool = False,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 rank: int | None = None, world_size: int | None = None,
                 device: Any = None, output: str = "torch", prefetch: int | None = None,
                 prefetch_bytes: int | None = None, timeout: float = 300.0,
                 connect_timeout: float = 10.0,
                 normalize: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
                 normalize_dtype: str = "float32", shared_memory: bool = True,
                 progress: bool = False, log_every: float | None = None,
                 compression: str | None = None, data_socket: bool = True,
                 tls: bool | Mapping[str, Any] = False, token: str | None = None,
                 dns_refresh: float = RESOLVE_EVERY, resolver: Resolver | None = None) -> None:
        rank, world_size = default_rank_world(rank, world_size)
        self._options = o = LoaderOptions(
            dataset, batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank,
            world_size=world_size, device=device, output=output,
            **prefetching(prefetch, prefetch_bytes),
            timeout=timeout, connect_timeout=connect_timeout, normalize=normalize,
            normalize_dtype=normalize_dtype, shared_memory=shared_memory, progress=progress,
            log_every=log_every, compression=compression, data_socket=data_socket,
            batch_tokens=batch_tokens, token_cost=token_cost, pack=pack,
            channels=ChannelMaker(tls, token))
        self._normalize = o.normalizer()
        self._servers = ServerSet(address, o.channels, dns_refresh=dns_refresh,
                                  resolver=resolver)
        self.address = self._servers.describe()
        self.dataset = dataset
        self._coords = o.coordinates
        self._epoch = 0
        # Positions of this epoch consumed before these coordinates took over (an elastic
        # resume, load_state_dict); 0 for every epoch that starts here.
        self._start = 0
        self._next = 0
        self._feed = None
        if o.on_device:
            from ._device import DeviceFeed

            # prefetch batches can wait in pinned buffers, plus one being filled and one
            # whose copy to the device is still running.
            self._feed = DeviceFeed(o.device, max_buffers=o.prefetch + 2,
                                    normalize=self._normalize)
        # Batches in flight, plus the one the caller holds and the one it just let go.
        self._host = HostBuffers(max_buffers=o.prefetch + 2)
        # Describe's answers by start: the whole epoch (0), and the rest of a resumed one.
        self._described: dict[int, pb.DescribeDatasetResponse] = {}
        self._pin: Pin | None = None  # the fingerprint read, from the first Describe
        self._checked = False  # every reachable server asked once for its fingerprint
        self._scheduler: Scheduler | None = None
        self._window = o.prefetch  # under every server's max_credits once they said it
        self._max_credits = MAX_CREDITS  # the lowest the servers said
        self._sized = False  # the window is fitted to the batches' size (see _fit_window)
        self._widened = False  # ... and was widened for small batches
        self._batch_bytes = 0  # of the latest batch received
        self._next_report: float | None = None  # when the stall goes to the servers next
        self._reported: collections.deque[tuple[float, float]] = collections.deque()
        self._said_waiting = (-1, -1)  # (epoch, batch) whose long wait was logged
        self._stats = {"batches": 0, "bytes": 0, "wait_seconds": 0.0, "loop_seconds": 0.0,
                       "failovers": 0, "hedges": 0}
        self._loop_started: float | None = None  # while an iteration runs
        # A mixture's samples by component (`source`): of batches handed out, and of batches
        # received (by (epoch, batch), from receive threads) and not handed out yet.
        self._sources: dict[int, int] = {}
        self._batch_sources: dict[tuple[int, int], list[int]] = {}
        self._started = time.perf_counter()
        self._transports = Transports()  # each server's path, for stats()

    # -- positions -------------------------------------------------------------------------
    def coordinates(self) -> pb.Coordinates:
        """This position's coordinates, with the pinned fingerprint once there is one."""
        return pb.Coordinates(epoch=self._epoch, start=self._start, **self._coords,
                              fingerprint=self._pin.digest if self._pin else "")

    def __len__(self) -> int:
        """Batches per epoch for this rank (ValueError if there are none: see describe); in
        an epoch resumed at another world_size or batch_size, the batches of its rest (maybe
        0)."""
        described = self.describe()
        if not self._start:
            check_epoch(described, self._options)
        return described.batches_per_epoch

    def describe(self) -> pb.DescribeDatasetResponse:
        """The dataset's fields and sizes under these coordinates (asked once, then cached;
        in a resumed epoch's rest, the sizes of that rest).

        Any server will do: they are tried in turn, with backoff, for up to `connect_timeout`
        s while none has answered at all (then UNAVAILABLE naming every address and what
        happened there), for up to `timeout` s once one has."""
        described = self._described.get(self._start)
        if described is None:
            o = self._options
            contact = first_contact(
                self._servers, lambda: pb.DescribeDatasetRequest(coordinates=self.coordinates()),
                connect_timeout=o.connect_timeout, timeout=o.timeout, tls=o.channels.tls,
                refuse=self._refuse)
            described, address = contact.described, contact.server.address
            if self._pin is None:
                self._pin = Pin.of(described.fingerprint, address)
            self._described[self._start] = described
            self._heed_max_credits(described.max_credits, address)
            # What every epoch leaves out (token budgets drop at most world_size - 1 samples)
            if not self._start and o.batch_tokens is None:
                say_dropped(described, o)
        return described

    def _refuse(self, err: RemoteError) -> None:
        """Raise what a server answered Describe with that no other server would mend."""
        if isinstance(err, DataMismatch) and self._pin is not None:
            raise self._mismatched(err.address, err.digest) from None
        if err.code in FATAL:
            raise err from None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a different epoch starts at batch 0, the current one keeps its
        place (so the usual `set_epoch(epoch)` at the top of an epoch loop resumes)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch, self._start, self._next = epoch, 0, 0

    def _next_epoch(self) -> None:
        self._epoch, self._start, self._next = self._epoch + 1, 0, 0

    def state_dict(self) -> dict[str, Any]:
        """The position: the epoch and the batch that comes next (a finished epoch's state is
        the start of the next epoch), and the fingerprint of the data it is a position in.
        In an epoch resumed at another world_size or batch_size, `coordinates` also holds
        `start`, the positions consumed before this loader took over."""
        epoch, start, next_batch = self._epoch, self._start, self._next
        if next_batch and next_batch >= len(self):
            epoch, start, next_batch = epoch + 1, 0, 0
        # `start` only where it is not 0: such a state stays what stoker saved before it had
        # elastic resume, and an older stoker refuses (coordinates differ) the states it
        # would resume at the wrong place.
        coords = {**self._coords, "start": start} if start else dict(self._coords)
        state = {"coordinates": coords, "epoch": epoch, "next_batch": next_batch}
        if self._pin is not None and self._pin.digest:
            state["fingerprint"] = self._pin.state()
        return state

    def load_state_dict(self, state: dict[str, Any], *, allow_changed_data: bool = False
                        ) -> None:
        """Resume at `state`'s position, saved by any rank of the job, at this world_size and
        batch_size or others (then the rest of the epoch's order is re-partitioned among this
        loader's ranks: docs/client.md#resuming). ValueError naming the key where the state's
        dataset, seed, shuffle or drop_last differ from this loader's. If it records a
        fingerprint and the servers now hold other data, the rest of the epoch would not be
        the rest of that order: ValueError, unless `allow_changed_data` (the loader then goes
        on with the servers' data)."""
        saved_coords = state.get("coordinates") if isinstance(state, Mapping) else None
        if not isinstance(saved_coords, Mapping):
            raise ValueError("state_dict has no 'coordinates': not a RemoteLoader.state_dict() "
                             f"(keys: {sorted(state) if isinstance(state, Mapping) else state!r})")
        differ = [f"{k}: saved {saved_coords.get(k, '(missing)')!r}, this loader "
                  f"{self._coords.get(k, '(missing)')!r}"
                  for k in sorted(set(saved_coords) | set(self._coords))
                  if k not in ELASTIC
                  and saved_coords.get(k, _MISSING) != self._coords.get(k, _MISSING)]
        if differ:
            raise ValueError("state_dict is for other coordinates (" + "; ".join(differ)
                             + "): a position is only valid in the epoch order it was saved "
                             "in (rank, world_size and batch_size may differ)")
        saved_at = _position(state, saved_coords)
        saved = state.get("fingerprint")
        if saved and saved.get("digest") and not allow_changed_data:
            self.describe()
            pin = self._pin
            if pin is not None and pin.digest and pin.digest != saved["digest"]:
                raise ValueError(
                    f"state_dict was saved against dataset {self.dataset!r} "
                    f"{short(saved['digest'], saved.get('objects'), saved.get('bytes'))}; "
                    f"the servers now have {short(pin.digest, pin.objects, pin.bytes)} (from "
                    f"{pin.address}): the rest of the epoch would not be the rest of that "
                    "order; pass load_state_dict(state, allow_changed_data=True) to go on "
                    "anyway")
        epoch, start, next_batch = saved_at["epoch"], saved_at["start"], saved_at["next_batch"]
        world_size, batch_size = saved_at["world_size"], saved_at["batch_size"]
        if (world_size, batch_size) == (self._coords["world_size"], self._coords["batch_size"]):
            self._epoch, self._start, self._next = epoch, start, next_batch
        elif self._coords.get("batch_tokens"):
            # A token budget's steps hold different numbers of samples, cut by a plan the
            # client does not see: the consumed prefix is not next_batch * a batch size.
            raise ValueError(f"state_dict was saved at world_size={world_size}; under "
                             "batch_tokens it resumes only at the same world_size, got "
                             f"{self._coords['world_size']} (elastic resume of token budgets "
                             "is not supported yet: docs/client.md#token-budgets)")
        else:
            # Every rank of the saving job had consumed its first next_batch batches, all
            # full (only an epoch's last batch can be short, and a finished epoch is saved as
            # the next one's start): the epoch's positions [0, consumed), a prefix.
            consumed = start + next_batch * batch_size * world_size
            self._epoch, self._start, self._next = epoch, consumed, 0

    # -- iteration -------------------------------------------------------------------------
    def _check_servers(self) -> None:
        """Ask every server that answers for its fingerprint, once: servers with other data
        than the pinned one are a DataMismatch before any batch is used. (Servers that come
        up later refuse our streams themselves: the coordinates carry the digest.)"""
        pin = self._pin
        self._checked = True
        if pin is None:
            return
        others = [(s.address, s.channel) for s in self._servers.servers.values()
                  if s.address != pin.address]
        plain = pb.Coordinates(epoch=self._epoch, **self._coords)
        found = describe_each(others, plain, min(10.0, self._options.timeout))
        for address, err in found.items():
            if isinstance(err, RemoteError):
                say(logging.WARNING, "%s did not answer (%s); going on with the servers that "
                    "did, and trying it again in the background", address, err)
        for address, d in found.items():
            if isinstance(d, RemoteError):
                continue
            fp = d.fingerprint
            if pin.digest and fp.digest and fp.digest != pin.digest:
                raise mismatch(self.dataset, pin, address, fp.digest, fp)
            self._heed_max_credits(d.max_credits, address)

    def _mismatched(self, address: str, digest: str) -> DataMismatch:
        """The DataMismatch for a server that refused our fingerprint, with its own."""
        assert self._pin is not None
        server = self._servers.servers.get(address)
        plain = pb.Coordinates(epoch=self._epoch, **self._coords)
        found = describe_each([(address, server.channel)] if server else [], plain,
                              min(10.0, self._options.timeout)).get(address)
        fp = None if found is None or isinstance(found, RemoteError) else found.fingerprint
        return mismatch(self.dataset, self._pin, address, digest, fp)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        total = len(self)  # ValueError for an epoch without a batch
        o = self._options
        if not self._checked:
            self._check_servers()
        if self._normalize is not None and not self._normalize.axes:
            self._normalize.validate(self.describe().fields)  # here, not on a receive thread
        if o.pack and MASK not in {f.name for f in self.describe().fields}:
            raise ValueError(f"pack=True packs the tokens {MASK!r} marks, but dataset "
                             f"{self.dataset!r} has no {MASK} (its fields: "
                             f"{sorted(f.name for f in self.describe().fields)}): give it a "
                             "length_column that is a list (docs/client.md#token-budgets)")
        if self._next and self._next >= total:  # finished (saved on an epoch's last batch)
            self._next_epoch()
            total = len(self)
        elif not total:  # the rest of a resumed epoch has no batch here: it is over
            self._next_epoch()
            return
        spec = StreamSpec(self.coordinates(), self._allocate, self._finish,
                          shm_probe=samehost.probe() if o.shared_memory else None,
                          compression=o.compression or "",
                          # compressed frames: for links slower than the CPUs; the data
                          # connection sends payloads as they are
                          data_socket=o.data_socket and not o.compression,
                          link=o.channels.link, transports=self._transports)
        scheduler = Scheduler(self._servers, spec, total=total, start=self._next,
                              window=self._window, timeout=o.timeout,
                              group=group_for(self._window) if self._widened else 1)
        self._scheduler = scheduler
        progress = None
        if o.progress or o.log_every is not None:
            progress = Progress(bar=o.progress, log_every=o.log_every, total=total,
                                start=self._next, label=f"{self.dataset} epoch {self._epoch}")
        self._loop_started = time.perf_counter()
        if self._next_report is None:
            self._next_report = self._loop_started + REPORT_FIRST
        elif self._stats["loop_seconds"] > 0:
            self._report(scheduler, 0.0)  # a new stream: tell it what the loop is like
        try:
            while self._next < total:
                t0 = time.perf_counter()
                try:
                    batch = scheduler.take(
                        self._next, on_wait=lambda t0=t0: self._waiting(scheduler, t0))
                except DataMismatch as e:  # a server refused our fingerprint: name both
                    raise self._mismatched(e.address, e.digest) from None
                waited = time.perf_counter() - t0
                self._stats["wait_seconds"] += waited
                if not self._sized:
                    self._fit_window(scheduler)
                if self._feed is not None:
                    batch = self._feed.hand_over(*batch)
                if o.pack:
                    from .packing import pack_padded

                    batch = pack_padded(batch)
                counts = self._batch_sources.pop((self._epoch, self._next), None)
                for source, n in enumerate(counts or ()):
                    self._sources[source] = self._sources.get(source, 0) + n
                self._next += 1
                self._stats["batches"] += 1
                if progress is not None:
                    progress.step(self._next - 1, waited, scheduler.received())
                self._report_due(scheduler, None)
                yield batch
            self._next_epoch()
        finally:
            self._stats["loop_seconds"] += time.perf_counter() - self._loop_started
            self._loop_started = None
            if progress is not None:
                progress.close()
            scheduler.close()
            self._batch_sources.clear()  # received ahead, never handed out
            self._scheduler = None
            self._stats["bytes"] += scheduler.bytes_received
            self._stats["failovers"] += scheduler.failovers
            self._stats["hedges"] += scheduler.hedges

    def _waiting(self, scheduler: Scheduler, since: float) -> None:
        """Called while the loop waits for batch self._next: report the stall when due, and
        say once, after SAY_WAITING s, what it waits for."""
        self._report_due(scheduler, since)
        where = (self._epoch, self._next)
        if self._said_waiting != where and time.perf_counter() - since >= SAY_WAITING:
            self._said_waiting = where
            say(logging.INFO, "%s epoch %d: waiting %.0fs for batch %d (giving up after "
                "timeout=%gs without a batch from any server): %s", self.dataset, self._epoch,
                time.perf_counter() - since, self._next, self._options.timeout,
                scheduler.servers_now())

    def _report_due(self, scheduler: Scheduler, waiting_since: float | None) -> None:
        """Send the stall to the servers if it is time (the loop's thread; `waiting_since`:
        when the wait for the current batch began, None between batches)."""
        now = time.perf_counter()
        if self._next_report is not None and now >= self._next_report:
            self._report(scheduler, now - waiting_since if waiting_since is not None else 0.0)

    def _report(self, scheduler: Scheduler, waiting: float) -> None:
        """The servers' stoker_client_data_stall: the wait and loop seconds of about the
        last REPORT_WINDOW s of the loop, with the wait still running."""
        now = time.perf_counter()
        self._next_report = now + REPORT_EVERY
        loop = self._stats["loop_seconds"] + (now - self._loop_started
                                              if self._loop_started is not None else 0.0)
        wait = self._stats["wait_seconds"] + waiting
        sent = self._reported  # (wait, loop) totals of earlier reports, oldest first
        while len(sent) > 1 and loop - sent[1][1] >= REPORT_WINDOW:
            sent.popleft()
        base = sent[0] if sent and loop - sent[0][1] >= REPORT_WINDOW else (0.0, 0.0)
        sent.append((wait, loop))
        scheduler.report(wait - base[0], loop - base[1])

    def _heed_max_credits(self, max_credits: int, address: str) -> None:
        """A server said its max_credits: the window stays under it, and so does any
        widening of it later (0: a server that did not say)."""
        self._window = credit_window(self._window, max_credits, address)
        if max_credits:
            self._max_credits = min(self._max_credits, max_credits)

    def _fit_window(self, scheduler: Scheduler) -> None:
        """Once the first batch's size is known: small batches are kept in flight by
        prefetch_bytes, not prefetch (each costs the servers a fixed time, which more in
        flight, asked for in groups, hides); the buffer pools grow to match. Once per
        loader: batches of one dataset and coordinates keep their size, near enough."""
        if not self._batch_bytes:
            return
        self._sized = True
        if not self._options.prefetch_bytes:
            return
        # Half the servers' max_credits at most: failover and hedges credit on top of it.
        window = self._options.window_for(self._batch_bytes, self._max_credits // 2)
        if window > self._window:
            self._window = window
            self._widened = True
            self._host.grow(window + 2)
            if self._feed is not None:
                self._feed.pool.grow(window + 2)
            scheduler.widen(window)

    def _allocate(self, nbytes: int) -> tuple[Any, np.ndarray]:
        self._batch_bytes = nbytes
        if self._feed is not None:
            return self._feed.allocate(nbytes)
        buf = self._host.acquire(nbytes)
        return buf, buf

    def _count_sources(self, batch: Assembled) -> None:
        """A mixture's batch: how many of its samples each component gave (its `source`
        field), read from the host bytes before any copy to a device; stats() adds them up
        when the batch is handed out."""
        t = next((t for t in batch.tensors if t.name == "source"), None)
        if t is None or t.dtype != "int64":
            return
        raw = batch.buffer[t.offset : t.offset + t.nbytes]
        data = raw if isinstance(raw, np.ndarray) else raw.numpy()  # a pinned torch tensor
        counts = np.bincount(np.frombuffer(np.ascontiguousarray(data), "<i8"))
        self._batch_sources[(batch.epoch, batch.batch_index)] = counts.tolist()

    def _finish(self, batch: Assembled) -> Any:
        self._count_sources(batch)
        if self._feed is not None:
            return self._feed.to_device(batch.buffer, batch.tensors)
        arrays = numpy_views(batch.buffer, batch.tensors)
        if self._options.output == "numpy":
            return self._normalize.numpy(arrays) if self._normalize else arrays
        import torch

        tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
        return self._normalize.torch(tensors) if self._normalize else tensors

    # -- telemetry and lifecycle -----------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """batches handed out; bytes received (batches fetched ahead included); seconds the
        caller waited for data and seconds spent iterating (`stall`: their ratio, the share of
        the loop's time it waited for data); batches/s since the loader was made; failovers
        (times a server's batches were asked of another because it failed or stalled);
        hedges (times the awaited batch was also asked of a second server); `prefetch`: the
        batches requested ahead now (more than prefetch for small batches); each server's
        state and figures; how many host buffers were allocated (pinned ones with a CUDA device):
        batches reuse buffers that nothing refers to any more; for a mixture, `sources`: the
        samples handed out by component (its index in the mixture's `components:`)."""
        live = self._scheduler
        now = time.perf_counter()
        elapsed = now - self._started
        loop = self._stats["loop_seconds"] + (now - self._loop_started
                                              if self._loop_started is not None else 0.0)
        stats = {**self._stats,
                 "loop_seconds": loop,
                 "stall": self._stats["wait_seconds"] / loop if loop > 0 else 0.0,
                 "bytes": self._stats["bytes"] + (live.received() if live else 0),
                 "failovers": self._stats["failovers"] + (live.failovers if live else 0),
                 "hedges": self._stats["hedges"] + (live.hedges if live else 0),
                 "batches_per_second": self._stats["batches"] / elapsed if elapsed else 0.0,
                 "epoch": self._epoch, "start": self._start, "next_batch": self._next,
                 "prefetch": self._window,
                 **({"sources": dict(sorted(self._sources.items()))} if self._sources else {}),
                 "servers": {a: s.stats() for a, s in self._servers.servers.items()},
                 **self._transports.stats()}
        if self._feed is not None:
            stats["pinned_allocations"] = self._feed.pool.allocations
        else:
            stats["host_allocations"] = self._host.allocations
        return stats

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        self._servers.close()
        self._host.clear()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _position(state: Mapping[str, Any], coords: Mapping[str, Any]) -> dict[str, int]:
    """A state's epoch, start and next_batch, and the world_size and batch_size it was saved
    at (`start` 0 where absent: saved before elastic resume, or at an epoch's beginning);
    ValueError naming the key that holds no such value."""
    found = {}
    for key, where, least in (("epoch", state, 0), ("next_batch", state, 0),
                              ("start", coords, 0), ("world_size", coords, 1),
                              ("batch_size", coords, 0 if coords.get("batch_tokens") else 1)):
        value = where.get(key, 0 if key == "start" else _MISSING)
        try:  # ints, numpy's included; not bools, floats or strings
            number = -1 if isinstance(value, bool) else operator.index(value)
        except TypeError:
            number = -1
        if number < least:
            raise ValueError(f"state_dict's {key!r} must be an int >= {least}, got "
                             f"{'(missing)' if value is _MISSING else repr(value)}")
        found[key] = number
    return found
