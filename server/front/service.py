"""The gRPC front end: the DataService methods, on grpc.aio.

This module holds the handler table, the unary methods, the coordinate checks and the
per-client stream limit; one StreamSession (server/front/session.py) serves each batch stream,
seeing of the service only the SessionContext (server/front/session_context.py) made here.

Threading contract: every method runs on the server's one asyncio loop. Batch work happens in
the worker processes; the front end only validates, schedules and sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from stoker.v1 import stoker_pb2 as pb
from stoker.v1.wire import FINGERPRINT_KEY

from .._config import Config
from ..order import token_batches
from ..order.epochs import consumed, epoch_size, locate, samples_of
from ..order.fingerprint import Fingerprint, short_digest
from ..order.sampling import (
    ORDER_LEGACY,
    ORDERS_KNOWN,
    CoordinateError,
    Coordinates,
    Exclusion,
)
from ..pool import shm
from ..pool.layout import SOURCES
from ..pool.workers import BatchFailed, DatasetMeta, WorkerPool
from .credits import FAILURE_CODE
from .grants import CALLER, OPEN, Grant
from .limits import Admission, Kind, Refused
from .metrics import Metrics
from .redact import redact
from .refusal import Abort
from .session import StreamSession
from .session_context import SessionContext
from .shared_batches import SharedBatches
from .tables import Tables

if TYPE_CHECKING:
    import numpy as np

    from ..pool.layout import BuiltBatch
    from .data_listener import DataSockets

log = logging.getLogger("stoker.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DataService"].full_name
# Seconds ListDatasets waits for a lake table's current snapshot to open (server/front/tables.py)
LIST_WAIT = 10.0


def client_of(peer: str) -> str:
    """The client's address without its port: `ipv4:10.0.0.5:41234` -> `ipv4:10.0.0.5`."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


def _shorten(name: str, limit: int = 100) -> str:
    """`name` quoted for a status message, cut to `limit` characters: gRPC refuses a status
    whose details pass 16 KiB (the client got UNKNOWN "Stream removed" instead)."""
    return repr(name) if len(name) <= limit else f"{name[:limit]!r}... ({len(name)} characters)"


def fingerprint_pb(fp: Fingerprint | None) -> pb.Fingerprint | None:
    return None if fp is None else pb.Fingerprint(digest=fp.digest, objects=fp.objects,
                                                   bytes=fp.bytes, orders=ORDERS_KNOWN,
                                                   snapshot=fp.snapshot)


def _parse(message: Any, raw: bytes) -> Any:
    try:
        return message.FromString(raw)
    except DecodeError as e:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                    f"request: not a valid {message.DESCRIPTOR.full_name}: {e}") from None


def _parsed(method: Any, message: Any) -> Any:
    """A unary method taking the request's bytes, parsed into `message`."""
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = _parse(message, raw)
        except Abort as e:
            await context.abort(e.code, str(e))
        return await method(request, context)
    return handle


class DataService:
    """The handler table, the unary methods, coordinate checks and per-client limits; each
    StreamBatches call is served by a StreamSession (server/front/session.py), handed the
    SessionContext made here. `data_sockets`: the data-connection listener (already
    listening), None where none is offered."""

    def __init__(self, config: Config, pool: WorkerPool, meta: dict[str, DatasetMeta],
                 data_sockets: DataSockets | None = None, metrics: Metrics | None = None
                 ) -> None:
        self._config = config
        self.metrics = metrics or Metrics(pool.status, pool.capacity)
        self._streams = itertools.count()
        self.pool = pool
        self.mappings = shm.ReadMappings()  # of the workers' segments, kept between batches
        self._meta = meta
        # Lake tables: each snapshot a job reads, opened on its first Describe (tables.py).
        self.tables = Tables(config, pool.opened)
        self.settings = config.server
        self.draining = False
        if data_sockets is not None:
            self.metrics.data_port(data_sockets)
        # Open streams and health watches, held shared memory: per client and in all.
        self.admission = Admission(self.settings)
        # Built batches, shared by the streams that ask for the same ones (issue 17).
        self.shared = SharedBatches(pool, config.cache, self.metrics, self._built)
        # What every stream reads of the service, and nothing more.
        self._sessions = SessionContext(
            settings=self.settings, metrics=self.metrics, shared=self.shared,
            admission=self.admission, mappings=self.mappings, data_sockets=data_sockets,
            coordinates=self.coordinates, lookahead=lambda: self.lookahead,
            draining=lambda: self.draining)

    @property
    def lookahead(self) -> int:
        """Batches ahead of the one asked for whose samples the workers prefetch: one round
        of the workers' queues (as deep as the pool keeps them now), so a hint names a batch
        no worker holds yet, not one another worker is already building."""
        return self.settings.worker_count * self.pool.depth

    def _built(self, coords: Coordinates, indices: np.ndarray, batch: BuiltBatch) -> None:
        """A build ended well (once per build, however many streams share it): the worker's
        figures, and a mixture's samples by component."""
        self.metrics.built(coords.dataset, batch.build_seconds, batch.skipped)
        meta = self._meta.get(coords.dataset) or self.tables.meta_of(coords.dataset)
        if meta is not None:
            self.metrics.mixed(coords.dataset, meta.ordering, indices)

    # -- read by the HTTP control plane (another thread) ------------------------------------
    @property
    def meta(self) -> dict[str, DatasetMeta]:
        """Every dataset's meta; a lake table's at the snapshot a new job gets (once one
        job has described it)."""
        return {**self._meta, **self.tables.metas()}

    def format_of(self, dataset: str) -> str:
        return self._config.datasets[dataset].format

    def pool_status(self) -> dict[str, int]:
        return self.pool.status()

    def handler(self) -> grpc.GenericRpcHandler:
        """Method handlers; StreamBatches sends frames this module has already serialized."""
        # Requests arrive as bytes and are parsed here: a request that is not protobuf then
        # gets INVALID_ARGUMENT, where grpc's own deserializer answers UNKNOWN or INTERNAL.
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "ListDatasets": grpc.unary_unary_rpc_method_handler(
                _parsed(self.ListDatasets, pb.ListDatasetsRequest), None,
                pb.ListDatasetsResponse.SerializeToString),
            "DescribeDataset": grpc.unary_unary_rpc_method_handler(
                _parsed(self.DescribeDataset, pb.DescribeDatasetRequest), None,
                pb.DescribeDatasetResponse.SerializeToString),
            "Provenance": grpc.unary_unary_rpc_method_handler(
                _parsed(self.Provenance, pb.ProvenanceRequest), None,
                pb.ProvenanceResponse.SerializeToString),
            "StreamBatches": grpc.stream_stream_rpc_method_handler(
                self._stream_batches, None, bytes),
        })

    async def _stream_batches(self, requests: AsyncIterator[bytes],
                              context: grpc.aio.ServicerContext) -> None:
        async def parsed() -> AsyncIterator[pb.StreamRequest]:
            async for raw in requests:
                yield _parse(pb.StreamRequest, raw)

        await self.StreamBatches(parsed(), context)

    # -- unary methods ---------------------------------------------------------------------
    async def ListDatasets(self, request: pb.ListDatasetsRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListDatasetsResponse:
        """The datasets the caller's grant may read (every one without grants)."""
        grant = CALLER.get()
        for name in sorted(self.tables.names):  # a lake table: at its current snapshot
            if grant.allows(name):
                # A catalog that does not answer keeps its table out of the list, not the
                # list from the caller.
                with contextlib.suppress(Abort, TimeoutError):
                    await asyncio.wait_for(self.tables.prepare(name, ""), LIST_WAIT)
        return pb.ListDatasetsResponse(datasets=[
            pb.DatasetInfo(name=name, format=self._config.datasets[name].format,
                           num_samples=m.num_samples, fingerprint=fingerprint_pb(m.fingerprint))
            for name, m in sorted(self.meta.items()) if grant.allows(name)])

    async def DescribeDataset(self, request: pb.DescribeDatasetRequest,
                              context: grpc.aio.ServicerContext) -> pb.DescribeDatasetResponse:
        try:
            if CALLER.get().allows(request.coordinates.dataset):  # a lake table's snapshot
                await self.tables.prepare(request.coordinates.dataset,
                                          request.coordinates.snapshot)
            coords, meta = self.coordinates(request.coordinates, CALLER.get(),
                                            present=request.HasField("coordinates"))
        except Abort as e:
            await context.abort(e.code, str(e), trailing_metadata=e.trailers)
        located, taken = None, 0
        try:  # a token plan takes a while to make: off the loop
            if request.HasField("consumed"):
                taken = await asyncio.to_thread(consumed, meta, coords, request.consumed.steps)
            if request.HasField("locate"):
                sizes = [(w.from_step, w.world_size) for w in request.locate.world_sizes]
                epoch, start, index = await asyncio.to_thread(locate, meta, coords,
                                                              request.locate.step, sizes)
                located = pb.Located(epoch=epoch, batch_index=index, start=start)
                coords = dataclasses.replace(coords, epoch=epoch, start=start)
            batches, per_rank = await asyncio.to_thread(epoch_size, meta, coords)
        except CoordinateError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.DescribeDatasetResponse(located=located, consumed=taken,
            dataset=request.coordinates.dataset,
            format=self._config.datasets[request.coordinates.dataset].format,
            num_samples=meta.num_samples, samples_per_rank=per_rank,
            batches_per_epoch=batches,
            fields=[pb.FieldSpec(name=n, dtype=d, shape=s) for n, d, s in meta.fields],
            fingerprint=fingerprint_pb(meta.fingerprint),
            max_credits=self.settings.max_credits,
            capacity=capacity_pb(*self.pool.capacity()))

    async def Provenance(self, request: pb.ProvenanceRequest,
                         context: grpc.aio.ServicerContext) -> pb.ProvenanceResponse:
        """Where each sample of a batch comes from: its indices here, their sources from a
        worker (which has the dataset open; pool/batch.py build_sources)."""
        try:
            coords, meta = self.coordinates(request.coordinates, CALLER.get(),
                                            present=request.HasField("coordinates"))
            indices = await asyncio.to_thread(samples_of, meta, coords, request.batch_index)
            built = await asyncio.wrap_future(self.pool.submit(coords.dataset, indices,
                                                               sources=True))
        except CoordinateError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Abort as e:
            await context.abort(e.code, str(e), trailing_metadata=e.trailers)
        except BatchFailed as e:
            await context.abort(FAILURE_CODE[e.kind], redact(str(e)) if self.settings.redact_paths
                                else str(e))
        try:
            t = next(t for t in built.tensors if t.name == SOURCES)
            raw = bytes(self.mappings.get(built.shm_name, built.payload_bytes)
                        [t.offset: t.offset + t.nbytes])
        finally:
            self.pool.release(built)
        return pb.ProvenanceResponse(samples=[
            pb.SampleSource(sample_index=int(i), **where)
            for i, where in zip(indices.tolist(), json.loads(raw), strict=True)])

    def coordinates(self, c: pb.Coordinates, grant: Grant = OPEN, present: bool = True
                    ) -> tuple[Coordinates, DatasetMeta]:
        """Checked coordinates and their dataset's meta; Abort naming the field if not. A
        dataset `grant` may not read is NOT_FOUND, as one not served is, and the message
        names only the datasets it may read."""
        if not present:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "coordinates: required")
        meta = self._meta.get(c.dataset) if grant.allows(c.dataset) else None
        dataset = c.dataset  # as the pool names it: a lake table's at its snapshot
        if meta is None and c.dataset in self.tables.names and grant.allows(c.dataset):
            dataset, meta = self.tables.lookup(c.dataset, c.snapshot)
        elif c.snapshot and meta is not None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"snapshot: dataset {_shorten(c.dataset)} is not a lake table; it has "
                        "no snapshots")
        if meta is None:
            served = ", ".join(grant.visible({**self._meta, **dict.fromkeys(
                self.tables.names)})) or "(none)"
            raise Abort(grpc.StatusCode.NOT_FOUND,
                        f"dataset {_shorten(c.dataset)} is not served here; datasets: {served}")
        have = meta.fingerprint
        if c.fingerprint and have is not None and c.fingerprint != have.digest:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                        f"dataset {_shorten(c.dataset)}: this server has {have.short()}, the "
                        f"client expects {ascii(short_digest(c.fingerprint))[1:-1]}: the data "
                        "differs (listed at another time, or another config), and one loader "
                        "must not mix the two",
                        ((FINGERPRINT_KEY, have.digest),))
        try:
            coords = Coordinates(dataset, c.seed, c.epoch, c.shuffle, c.rank, c.world_size,
                                 c.batch_size, c.drop_last, c.start,
                                 c.batch_tokens, c.token_cost or "tokens",
                                 Exclusion.of(list(c.excluded), c.excluded_digest,
                                              meta.num_samples),
                                 c.order or ORDER_LEGACY)
            coords.validate(meta.num_samples)
            if coords.batch_tokens:
                token_batches.check(meta.lengths, coords)
        except CoordinateError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return coords, meta

    # -- the batch stream ------------------------------------------------------------------
    async def StreamBatches(self, requests: AsyncIterator[pb.StreamRequest],
                            context: grpc.aio.ServicerContext) -> None:
        """A batch stream, if its client (peer address, port aside) has fewer than
        max_streams_per_client streams and health watches open, on fewer than
        max_grpc_connections_per_client connections (this one aside), and the server fewer
        than max_streams: a client that opens streams without end would hold memory and a
        share of the workers each."""
        with contextlib.ExitStack() as admitted:
            client = client_of(context.peer())
            try:
                admitted.enter_context(self.admission.open(client, Kind.STREAM, context.peer()))
            except Refused as e:
                log.log(logging.WARNING if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                        else logging.INFO, "a stream from %s refused, %s: %s", context.peer(),
                        e.code.name, e)
                await context.abort(e.code, str(e))  # raises: the call ends here
            grant = CALLER.get()
            self.metrics.grant_streams.labels(grant.name).inc()
            session = StreamSession(self._sessions, context, next(self._streams), client,
                                    grant)
            try:
                await session.run(requests)
            finally:
                await session.close()


def capacity_pb(workers: int, samples_per_second: float) -> pb.Capacity:
    return pb.Capacity(workers=workers, samples_per_second=samples_per_second)
