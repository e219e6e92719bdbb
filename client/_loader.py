"""RemoteLoader: iterate over batches that data servers compute.

Threading: a RemoteLoader is used from one thread (the training loop). Behind it, one receive
thread per stream assembles batches, so at most `prefetch` batches wait in host memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from stoker.v1 import stoker_pb2 as pb

from ._checks import check_epoch, say_dropped
from ._epoch_pass import EpochPass, Loop
from ._errors import DataMismatch, RemoteError
from ._on_demand import OnDemand
from ._options import loader_options, signature
from ._stall import Stall
from .contact.agreement import FingerprintCheck
from .contact.first import first_contact
from .delivery.buffers import HostBuffers
from .delivery.sources import SourceCounts
from .fleet.kept import KeptScheduler
from .fleet.scheduler import FATAL
from .fleet.servers import ServerSet
from .fleet.window import Fleet, Window
from .position.place import Place
from .position.resume import LAST_EPOCH, Saved, state_of
from .transport import samehost
from .transport.datalink import Transports
from .transport.frames import Assembled
from .transport.stream import StreamSpec


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

    On demand (client/_on_demand.py): `batch_at(epoch, index)` any batch, `seek(step)` to a
    global step, `exclude(indices)` samples for the rest of the run, `provenance(epoch,
    index)` where a batch's samples come from; each one request (docs/client.md).

    Data: the loader pins the dataset's fingerprint from the first server that describes it
    and reads only from servers that have the same (DataMismatch otherwise, naming both); a
    state_dict records it, and resuming against other data is refused unless asked for.

    docs/client.md#signature says more of each argument below.

    Example (a server on port 50051 that serves a dataset `faces`)::

        from stoker.client import RemoteLoader

        with RemoteLoader("localhost:50051", "faces", batch_size=64, output="numpy") as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                for batch in loader:
                    images, labels = batch["image"], batch["label"]

    Args:
        address: `"host:port"` of one data server, a list of them, or one
            `"dns:///name:port"` whose records are the servers (re-resolved every
            `dns_refresh` s).
        dataset: a dataset name from the servers' config.
        batch_size: samples per batch; give it or `batch_tokens`, not both.
        batch_tokens: instead of `batch_size`, batches cut by tokens: at most this many
            real tokens per rank per batch, balanced across ranks.
        token_cost: with `batch_tokens`, what ranks are balanced by: `"tokens"` or
            `"squares"` (the sum of squared lengths).
        pack: each batch packed into one row with `cu_seqlens` (needs `output="torch"`).
        seed: the shuffle seed.
        shuffle: a permutation drawn from (seed, epoch); False: dataset order.
        drop_last: drop this rank's last short batch.
        order: the shuffled order's version, `"index"` or `"legacy"` (what older states
            resume).
        snapshot: a lake table's snapshot (format iceberg, delta or lance) to read; None:
            the server's pin, else the table's current snapshot at first contact, which the
            job keeps (and `state_dict` records).
        rank: this trainer's rank (None: torch.distributed, else RANK, else 0).
        world_size: trainers in the job (None: torch.distributed, else WORLD_SIZE, else 1).
        device: None or a CPU device: host tensors; a CUDA device: batches copied there
            through pinned buffers.
        output: `"torch"` (dicts of tensors) or `"numpy"` (dicts of arrays, no torch).
        prefetch: batches requested ahead of the loop (None: 8, more for small batches,
            adapting to the servers and the loop's stall).
        prefetch_bytes: with small batches, request as many ahead as this many bytes hold
            (None: 32 MiB when `prefetch` is not given either, else 0).
        memory_budget: bytes of buffers the batches in flight may fill when the window
            adapts.
        prefetch_next_epoch: ask for the next epoch's first batches while an epoch ends.
        timeout: seconds without progress before giving up (UNAVAILABLE).
        connect_timeout: seconds to wait for a first answer from any server.
        normalize: `{field: (mean, std)}`: uint8 image fields become
            `(x / 255 - mean) / std`, computed on the batch's device.
        normalize_dtype: the dtype of normalized fields: `"float32"`, `"float16"` or
            `"bfloat16"` (torch only).
        shared_memory: read batches from a same-host server's shared memory where no plain
            data connection is used.
        progress: show a tqdm bar per iteration.
        log_every: log the loop's figures at most this often (seconds), or never (None).
        compression: None or `"zstd"`: ask the servers to compress frames.
        data_socket: receive batches on a connection of their own beside gRPC.
        tls: False (plain TCP), True (TLS, the system's roots) or a dict with `ca`,
            `cert`, `key`, `server_name`.
        token: the bearer token the servers require (None: `STOKER_TOKEN`, if set).
        dns_refresh: seconds between resolutions of a `dns:///` address.
        resolver: a callable `resolver(target) -> ["host:port", ...]` that replaces the
            system's resolver for a `dns:///` address.

    Raises:
        ValueError: an argument out of its range, naming it (`batch_size` and
            `batch_tokens` both or neither, `output="numpy"` with a device, ...).
        TypeError: an argument the loader does not take, naming it.
        ImportError: `compression="zstd"` without zstandard installed.

    Attributes:
        address: the servers it reads from, as one string.
        dataset: the dataset's name.
    """

    def __init__(self, address: str | Sequence[str], dataset: str,
                 batch_size: int | None = None, **options: Any) -> None:
        # The keyword arguments are LoaderOptions' fields (signature below: help() shows them)
        self._options = o = loader_options(dataset, batch_size, options)
        self._normalize = o.normalizer()
        self._servers = ServerSet(address, o.channels, dns_refresh=o.dns_refresh,
                                  resolver=o.resolver)
        self.address = self._servers.describe()
        self.dataset = dataset
        self._place = Place(o.coordinates)  # where it is: written there alone
        self._feed = None
        if o.on_device:
            from .delivery.device import DeviceFeed

            # prefetch batches wait in pinned buffers, + one filled, + one being copied.
            self._feed = DeviceFeed(o.device, max_buffers=o.prefetch + 2,
                                    normalize=self._normalize)
        # Batches in flight, plus the one the caller holds and the one it just let go.
        self._host = HostBuffers(max_buffers=o.prefetch + 2)
        # Describe's answers by (epoch, start) (epoch 0 stands for every epoch but under
        # batch_tokens, whose plans differ): the whole epoch (start 0), a resumed one's rest.
        self._described: dict[tuple[int, int], pb.DescribeDatasetResponse] = {}
        self._agreement = FingerprintCheck(dataset, self._servers, o.timeout,
                                           self._place.coords.order)
        self._window = Window(o.prefetch, o.adapts, o.memory_budget)
        self._stall = Stall(dataset, o.timeout)
        self._stats = {"batches": 0}
        self._sources = SourceCounts()  # a mixture's samples by component
        self._kept = KeptScheduler(self._servers, self._spec, self._sources.forget_ahead)
        self._started = time.perf_counter()
        self._on_demand = OnDemand(self, self._place, self._normalize, o, self._agreement,
                                   self._described, self._ask)
        self._transports = Transports()  # each server's path, for stats()
        # What a pass over an epoch reads and moves: the parts above, by name.
        self._loop = Loop(dataset, o, self._place, self._stats, self._kept, self._agreement,
                          self._window, self._stall, self._sources, self._host, self._feed,
                          self._normalize, self._on_demand, self.__len__, self.describe,
                          self.coordinates, self._mismatched)

    __init__.__signature__ = signature()  # type: ignore[attr-defined]

    # -- positions -------------------------------------------------------------------------
    def coordinates(self) -> pb.Coordinates:
        """This position's coordinates, with the pinned fingerprint once there is one.

        Returns:
            The `Coordinates` message a stream of this position opens with: dataset, seed,
            shuffle, rank, world_size, batch size, the epoch and its `start`.
        """
        agreed = self._agreement.fingerprint
        at = self._place.at
        return self._place.coords.message(at.epoch, at.start, agreed.digest if agreed else "")

    def __len__(self) -> int:
        """Batches per epoch for this rank (ValueError if there are none: see describe); in
        an epoch resumed at another world_size or batch_size, the batches of its rest (maybe
        0)."""
        described = self.describe()
        if not self._place.at.start:
            check_epoch(described, self._options)
        return described.batches_per_epoch

    def describe(self) -> pb.DescribeDatasetResponse:
        """The dataset's fields and sizes under these coordinates (asked once, then cached;
        in a resumed epoch's rest, the sizes of that rest).

        Any server will do: they are tried in turn, with backoff, for up to `connect_timeout`
        s while none has answered at all (then UNAVAILABLE naming every address and what
        happened there), for up to `timeout` s once one has.

        Returns:
            Describe's answer: the fields (name, dtype, shape), `num_samples`,
            `batches_per_epoch` and, for a mixture, its components.

        Raises:
            RemoteError: NOT_FOUND for a dataset the servers do not serve (naming those they
                do), INVALID_ARGUMENT naming a bad coordinate, UNAVAILABLE when no server
                answered in time.
            DataMismatch: a server holds other data than the fingerprint pinned.
        """
        at = self._place.at
        return self._on_demand._sizes(at.epoch, at.start)

    def _ask(self, request: pb.DescribeDatasetRequest, epoch: int, start: int
             ) -> pb.DescribeDatasetResponse:
        """`request` of the first server that answers (see describe), its answer cached for
        `epoch`'s positions from `start`: the fingerprint pinned, the window told of it."""
        o = self._options
        contact = first_contact(self._servers, lambda: request, connect_timeout=o.connect_timeout,
                                timeout=o.timeout, tls=o.channels.tls, refuse=self._refuse)
        described = contact.described
        self._agreement.first(contact)
        agreed = self._agreement.fingerprint
        if agreed is not None and agreed.snapshot not in ("", self._place.coords.snapshot):
            # A lake table: the snapshot first contact resolved is this job's from now on,
            # whichever server serves it, and what state_dict records.
            self._place.pin_snapshot(agreed.snapshot)
        self._described[self._on_demand._key(epoch, start)] = described
        self._window.cap_credits(described.max_credits, contact.server.address)
        if described.HasField("capacity"):
            c = contact.server.capacity = (described.capacity.workers,
                                           described.capacity.samples_per_second)
            self._window.start(Fleet(*c, None))
        if not start and o.batch_tokens is None:  # what every epoch leaves out, said once
            say_dropped(described, o)
        return described

    def _refuse(self, err: RemoteError) -> None:
        """Raise what a server answered Describe with that no other server would mend."""
        if isinstance(err, DataMismatch) and self._agreement.fingerprint is not None:
            raise self._mismatched(err) from None
        if err.code in FATAL:
            raise err from None

    def _mismatched(self, err: DataMismatch) -> DataMismatch:
        """The DataMismatch for a server that refused our fingerprint: naming both."""
        return self._agreement.refused(err.address, err.digest,
                                     self._place.coords.message(self._place.at.epoch))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a different epoch starts at batch 0, the current one keeps its
        place (so the usual `set_epoch(epoch)` at the top of an epoch loop resumes).

        Args:
            epoch: the epoch, in [0, 2**63 - 1].

        Raises:
            ValueError: `epoch` out of that range.
        """
        if not 0 <= epoch <= LAST_EPOCH:
            raise ValueError(f"epoch must be in [0, 2**63 - 1], got {epoch}")
        self._place.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The position: the epoch and the batch that comes next (a finished epoch's state is
        the start of the next epoch), and the fingerprint of the data it is a position in.
        In an epoch resumed at another world_size or batch_size, `coordinates` also holds
        `start`, the positions consumed before this loader took over.

        Returns:
            A dict of plain values (save it with the model's checkpoint): `coordinates`,
            `epoch`, `next_batch`, and the fingerprint and exclusions where there are any.

        Example::

            state = loader.state_dict()
            ...  # later, maybe at another world_size
            loader.load_state_dict(state)
        """
        at = self._place.at
        if at.next_batch and at.next_batch >= len(self):
            at = at.following()
        return state_of(self._place.coords, at, self._agreement.fingerprint)

    def load_state_dict(self, state: dict[str, Any], *, allow_changed_data: bool = False
                        ) -> None:
        """Resume at `state`'s position, saved by any rank of the job, at this world_size and
        batch_size or others (then the rest of the epoch's order is re-partitioned among this
        loader's ranks: docs/client.md#resuming). ValueError naming the key where the state's
        dataset, seed, shuffle or drop_last differ from this loader's. If it records a
        fingerprint and the servers now hold other data, the rest of the epoch would not be
        the rest of that order: ValueError, unless `allow_changed_data` (the loader then goes
        on with the servers' data).

        Args:
            state: what `state_dict()` returned (of this loader or of any rank of the job).
            allow_changed_data: go on where the servers' data is not the data `state` was
                saved against (its fingerprint differs).

        Raises:
            ValueError: naming the key where `state`'s dataset, seed, shuffle or drop_last
                differ from this loader's, a state that is not one, or changed data (unless
                `allow_changed_data`).
        """
        saved = Saved.read(state, self._place.coords)
        if saved.order != self._place.coords.order:  # the run goes on in the order it began in
            self._place.reorder(saved.order)
            self._agreement.order = saved.order
            self._described.clear()
        if saved.snapshot != self._place.coords.snapshot:  # and on the table's snapshot it read
            self._place.pin_snapshot(saved.snapshot)
            self._described.clear()
        self.exclude(saved.excluded.indices if saved.excluded else ())
        if saved.digest and not allow_changed_data:
            self.describe()
            saved.check_data(self.dataset, self._agreement.fingerprint)
        self._place.load_state_dict(saved, self._on_demand._planned)

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The rest of the current epoch, then on to the next (see the class docstring)."""
        yield from EpochPass(self._loop)

    def _spec(self, coordinates: pb.Coordinates, allocate: Any = None,
              finish: Any = None) -> StreamSpec:
        """What the streams of a pass over `coordinates`' epoch ask for (the loop's buffers
        and conversion unless others are given)."""
        o = self._options
        return StreamSpec(coordinates, allocate or self._allocate, finish or self._finish,
                          shm_probe=samehost.probe() if o.shared_memory else None,
                          compression=o.compression or "",
                          # compressed frames: for links slower than the CPUs; the data
                          # connection sends payloads as they are
                          data_socket=o.data_socket and not o.compression,
                          link=o.channels.link, transports=self._transports,
                          empty=self._on_demand.empty_batch(allocate or self._allocate))

    def _allocate(self, nbytes: int) -> tuple[Any, np.ndarray]:
        """A buffer for a batch of `nbytes` (receive threads)."""
        self._window.batch_bytes = nbytes
        if self._feed is not None:
            return self._feed.allocate(nbytes)
        buf = self._host.acquire(nbytes)
        return buf, buf

    def _finish(self, batch: Assembled) -> Any:
        self._sources.received(batch)
        return self._on_demand.convert(batch, self._feed)

    # -- on demand (client/_on_demand.py): beside the loop, each one request ---------------
    def batch_at(self, epoch: int, index: int) -> dict[str, Any]:
        return self._on_demand.batch_at(epoch, index)

    def provenance(self, epoch: int, index: int) -> list[dict[str, Any]]:
        return self._on_demand.provenance(epoch, index)

    def seek(self, step: int, world_sizes: int | Sequence[tuple[int, int]] | None = None
             ) -> None:
        self._on_demand.seek(step, world_sizes)

    def exclude(self, sample_indices: Iterable[int]) -> None:
        self._on_demand.exclude(sample_indices)

    @property
    def excluded(self) -> tuple[int, ...]:
        """The samples this run leaves out (sorted dataset indices), see exclude."""
        return self._on_demand.excluded

    batch_at.__doc__, provenance.__doc__ = OnDemand.batch_at.__doc__, OnDemand.provenance.__doc__
    seek.__doc__, exclude.__doc__ = OnDemand.seek.__doc__, OnDemand.exclude.__doc__

    # -- telemetry and lifecycle -----------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """batches handed out; bytes received (batches fetched ahead included); seconds the
        caller waited for data and seconds spent iterating (`stall`: their ratio, the share of
        the loop's time it waited for data); batches/s since the loader was made; failovers
        (times a server's batches were asked of another because it failed or stalled);
        hedges (times a batch was also asked of a second server: the awaited one, or one a
        slow server would deliver late); `prefetch`: the batches requested ahead now (more
        than prefetch for small batches); each server's state and figures (its rate too);
        how many host buffers were allocated (pinned ones with a CUDA device): batches reuse
        buffers that nothing refers to any more; for a mixture, `sources`: the samples
        handed out by component (its index in the mixture's `components:`).

        Returns:
            A dict of those figures by name (docs/client.md#stats lists them all).
        """
        at, batches, figure = self._place.at, self._stats["batches"], self._kept.figure
        now = time.perf_counter()
        elapsed = now - self._started
        wait, loop = self._stall.wait_seconds, self._stall.loop_seconds(now)
        stats = {"batches": batches, "bytes": figure("bytes"),
                 "wait_seconds": wait, "loop_seconds": loop,
                 "failovers": figure("failovers"), "hedges": figure("hedges"),
                 "dropped": figure("dropped"),
                 "stall": wait / loop if loop > 0 else 0.0,
                 "batches_per_second": batches / elapsed if elapsed else 0.0,
                 "epoch": at.epoch, "start": at.start, "next_batch": at.next_batch,
                 "prefetch": self._window.size,
                 **self._window.stats(),
                 **self._sources.stats(),
                 "servers": {a: s.stats() for a, s in self._servers.servers.items()},
                 **self._transports.stats()}
        if self._feed is not None:
            stats["pinned_allocations"] = self._feed.pool.allocations
        else:
            stats["host_allocations"] = self._host.allocations
        return stats

    def close(self) -> None:
        """Close the streams and channels and free the buffers; a closed loader is not
        iterated again. `with RemoteLoader(...) as loader:` closes it on leaving."""
        self._kept.drop()
        self._servers.close()
        self._host.clear()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

