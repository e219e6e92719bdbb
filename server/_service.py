"""The gRPC front end: the DataService methods, on grpc.aio.

Threading contract: every method runs on the server's one asyncio loop. Batch work happens in
the worker processes; this module only validates, schedules and sends.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from stoker.v1 import stoker_pb2 as pb

from . import _shm
from ._batch import BuiltBatch
from ._config import Config
from ._frames import (
    encode_error,
    encode_frame,
    encode_shm_frame,
    encode_socket_frame,
    encode_socket_offer,
)
from ._metrics import Metrics
from ._sampling import (
    CoordinateError,
    Coordinates,
    EpochKey,
    batch_samples,
    batches_per_epoch,
)
from ._workers import DEPTH, BatchFailed, DatasetMeta, WorkerPool

log = logging.getLogger("stoker.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DataService"].full_name
_FAILURE_CODE = {"data_loss": grpc.StatusCode.DATA_LOSS, "internal": grpc.StatusCode.INTERNAL,
                 "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED}


def client_of(peer: str) -> str:
    """The client's address without its port: `ipv4:10.0.0.5:41234` -> `ipv4:10.0.0.5`."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _Failed:
    """A batch that could not be built: answered in-band, the stream goes on."""

    batch_index: int
    epoch: int
    code: grpc.StatusCode
    message: str


async def _write(context: grpc.aio.ServicerContext, frame: bytes) -> bool:
    """Send one frame; False if the client has gone (cancelled, disconnected)."""
    try:
        await context.write(frame)
    except Exception:
        if context.cancelled() or context.done():
            return False
        raise
    return True


# Seconds a stream waits for the data socket its client asked for before sending payloads in
# frames instead (a firewall, a client that could not connect).
SOCKET_WAIT = 5.0
# Frames smaller than this go plain: compressing them saves nothing worth a thread hop.
MIN_COMPRESS = 64 << 10


def _compressor(name: str) -> Any:
    """A zstd compressor for a stream that asked for one; None where zstandard is missing
    (frames then go plain, and say so)."""
    if name != "zstd":
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                     f"compression: {name!r} is not offered; this server offers 'zstd'")
    try:
        import zstandard
    except ImportError:
        return None
    # Level 1: about as fast as a 10 Gb/s link; higher levels cost CPU the workers need.
    return zstandard.ZstdCompressor(level=1)


def _shorten(name: str, limit: int = 100) -> str:
    """`name` quoted for a status message, cut to `limit` characters: gRPC refuses a status
    whose details pass 16 KiB (the client got UNKNOWN "Stream removed" instead)."""
    return repr(name) if len(name) <= limit else f"{name[:limit]!r}... ({len(name)} characters)"


def _parse(message: Any, raw: bytes) -> Any:
    try:
        return message.FromString(raw)
    except DecodeError as e:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                     f"request: not a valid {message.DESCRIPTOR.full_name}: {e}") from None


def _parsed(method: Any, message: Any) -> Any:
    """A unary method taking the request's bytes, parsed into `message`."""
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = _parse(message, raw)
        except _Abort as e:
            await context.abort(e.code, str(e))
        return await method(request, context)
    return handle


class DataService:
    def __init__(self, config: Config, pool: WorkerPool, meta: dict[str, DatasetMeta],
                 metrics: Metrics | None = None) -> None:
        self._config = config
        self.metrics = metrics or Metrics(pool.status)
        self.data_sockets: Any = None  # a DataSockets, set by the app once it listens
        self._streams = itertools.count()
        self._pool = pool
        self._mappings = _shm.ReadMappings()  # of the workers' segments, kept between batches
        self._meta = meta
        self._settings = config.server
        # Hints reach one round of the workers' queues ahead of the batch being asked for.
        self._lookahead = self._settings.worker_count * DEPTH
        self.draining = False
        self._streams_of: collections.Counter[str] = collections.Counter()  # client -> open

    # -- read by the HTTP control plane (another thread) ------------------------------------
    @property
    def meta(self) -> dict[str, DatasetMeta]:
        return self._meta

    def format_of(self, dataset: str) -> str:
        return self._config.datasets[dataset].format

    def pool_status(self) -> dict[str, int]:
        return self._pool.status()

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
        return pb.ListDatasetsResponse(datasets=[
            pb.DatasetInfo(name=name, format=self._config.datasets[name].format,
                           num_samples=m.num_samples)
            for name, m in sorted(self._meta.items())])

    async def DescribeDataset(self, request: pb.DescribeDatasetRequest,
                              context: grpc.aio.ServicerContext) -> pb.DescribeDatasetResponse:
        try:
            coords, meta = self._coordinates(request.coordinates, present=request.HasField(
                "coordinates"))
        except _Abort as e:
            await context.abort(e.code, str(e))
        return pb.DescribeDatasetResponse(
            dataset=coords.dataset, format=self._config.datasets[coords.dataset].format,
            num_samples=meta.num_samples,
            samples_per_rank=meta.num_samples // coords.world_size,
            batches_per_epoch=batches_per_epoch(meta.num_samples, coords),
            fields=[pb.FieldSpec(name=n, dtype=d, shape=s) for n, d, s in meta.fields])

    def _coordinates(self, c: pb.Coordinates, present: bool = True
                     ) -> tuple[Coordinates, DatasetMeta]:
        if not present:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "coordinates: required")
        meta = self._meta.get(c.dataset)
        if meta is None:
            served = ", ".join(sorted(self._meta)) or "(none)"
            raise _Abort(grpc.StatusCode.NOT_FOUND,
                         f"dataset {_shorten(c.dataset)} is not served here; datasets: {served}")
        coords = Coordinates(c.dataset, c.seed, c.epoch, c.shuffle, c.rank, c.world_size,
                             c.batch_size, c.drop_last)
        try:
            coords.validate()
        except CoordinateError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return coords, meta

    # -- the batch stream ------------------------------------------------------------------
    async def StreamBatches(self, requests: AsyncIterator[pb.StreamRequest],
                            context: grpc.aio.ServicerContext) -> None:
        """A batch stream, if its client (peer address, port aside) has fewer than
        max_streams_per_client open: a client that opens streams without end would hold
        memory and a share of the workers each."""
        client, limit = client_of(context.peer()), self._settings.max_streams_per_client
        if self._streams_of[client] >= limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"streams: this client has {self._streams_of[client]} open, "
                                f"this server allows max_streams_per_client={limit}")
        self._streams_of[client] += 1
        try:
            await self._stream(requests, context)
        finally:
            self._streams_of[client] -= 1
            if not self._streams_of[client]:
                del self._streams_of[client]

    async def _stream(self, requests: AsyncIterator[pb.StreamRequest],
                      context: grpc.aio.ServicerContext) -> None:
        """Answer every credited batch index once, in the order batches become ready.

        Ends when the client half-closes and every credit is answered. Batches that are built
        but unsent when the stream ends (cancelled, failed) have their shared memory freed.
        Writes go through context.write, not a generator: a write that fails because the
        client went away then ends the call quietly instead of logging a traceback.
        """
        ready: asyncio.Queue[Any] = asyncio.Queue()
        jobs: set[asyncio.Task] = set()
        # shm: the client reads batches from shared memory; lent: those it has not released.
        state: dict[str, Any] = {"outstanding": 0, "eof": False, "shm": False, "lent": {},
                                 "id": next(self._streams), "dataset": None, "zstd": None,
                                 "sock": None, "sock_wait": None, "token": b""}
        metrics = self.metrics
        reader = asyncio.create_task(self._read_credits(requests, ready, jobs, state))
        try:
            while not (state["eof"] and state["outstanding"] == 0):
                item = await ready.get()
                if item is None:
                    continue  # a wake-up from the reader
                if isinstance(item, _Abort):
                    await context.abort(item.code, str(item))
                if isinstance(item, bytes):  # the data socket offer: not a batch
                    if not await _write(context, item):
                        return
                    continue
                # A credit counts as answered once its batch starts out: the client may send
                # the next credit as soon as it has the last frame.
                state["outstanding"] -= 1
                if isinstance(item, _Failed):
                    metrics.errors.labels(state["dataset"], item.code.name.lower()).inc()
                    if not await _write(context, encode_error(
                            item.batch_index, item.epoch, item.code.value[0], item.message)):
                        return
                    continue
                batch, batch_index, epoch = item
                metrics.sent(state["dataset"], batch.tensors[-1].shape[0], batch.payload_bytes,
                             state["shm"])
                if state["sock_wait"] is not None or state["sock"] is not None:
                    sent = await self._send_via_socket(context, state, batch, batch_index, epoch)
                    if sent is not None:  # None: no socket came, frames carry it after all
                        self._pool.release(batch)  # on the wire (or nobody wants it)
                        if not sent:
                            return
                        continue
                if state["shm"]:
                    state["lent"][batch.shm_name] = batch  # until the client releases it
                    if not await _write(context, encode_shm_frame(batch, batch_index, epoch)):
                        return
                    continue
                try:
                    if not await self._send_frames(context, batch, batch_index, epoch,
                                                   state["zstd"]):
                        return
                finally:
                    self._pool.release(batch)
        finally:
            reader.cancel()
            for job in jobs:
                job.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(reader, *jobs, return_exceptions=True)
            while not ready.empty():
                item = ready.get_nowait()
                if isinstance(item, tuple):
                    self._pool.release(item[0])
            for batch in state["lent"].values():  # the client may be reading one still
                self._pool.release(batch, reuse=False)
            if state["token"] and self.data_sockets is not None:
                self.data_sockets.forget(state["token"])
            if state["sock"] is not None:
                state["sock"].close()
            if state["dataset"] is not None:
                metrics.streams.labels(state["dataset"]).dec()
            metrics.stream_ended(state["id"])

    async def _send_via_socket(self, context: grpc.aio.ServicerContext, state: dict[str, Any],
                               batch: BuiltBatch, batch_index: int, epoch: int) -> bool | None:
        """The batch's header as a frame, its payload on the data socket, straight from shared
        memory. True: sent; False: the client went away; None: its socket never came (the
        stream goes on with payloads in frames)."""
        if state["sock"] is None:
            try:
                async with asyncio.timeout(SOCKET_WAIT):
                    state["sock"] = await state["sock_wait"]
            except TimeoutError:
                state["sock_wait"] = None
                self.data_sockets.forget(state["token"])
                log.warning("a client asked for a data socket and did not connect within "
                            "%.0f s: its batches go in frames", SOCKET_WAIT)
                return None
            state["sock_wait"] = None
        if not await _write(context, encode_socket_frame(batch, batch_index, epoch)):
            return False
        segment = self._mappings.get(batch.shm_name, batch.payload_bytes)
        with memoryview(segment) as view:
            payload = view[: batch.payload_bytes]
            try:
                await asyncio.get_running_loop().sock_sendall(state["sock"], payload)
            except OSError:
                return False  # the client closed its socket: the stream ends too
            finally:
                payload.release()
        return True

    async def _send_frames(self, context: grpc.aio.ServicerContext, batch: BuiltBatch,
                           batch_index: int, epoch: int, zstd: Any) -> bool:
        """Send `batch` as frames over the socket; False if the client went away.

        Each frame's bytes are copied (or compressed from a copy) out of the segment before
        anything is awaited, so no view of the segment outlives a step: the segment can be
        handed back to its worker, and its mapping closed, whatever happens to the stream."""
        segment = self._mappings.get(batch.shm_name, batch.payload_bytes)
        total, step = batch.payload_bytes, self._settings.frame_bytes
        for offset in range(0, max(total, 1), step):
            with memoryview(segment) as view:
                chunk = view[offset : min(offset + step, total)]
                if zstd is not None and len(chunk) >= MIN_COMPRESS:
                    data, kind = bytes(chunk), "zstd"
                else:
                    frame = encode_frame(batch, chunk, offset, batch_index, epoch)
                    data, kind = None, ""
                chunk.release()
            if data is not None:
                # In a thread: zstd releases the GIL; the loop serves other streams.
                frame = encode_frame(batch, await asyncio.to_thread(zstd.compress, data),
                                     offset, batch_index, epoch, kind)
            if not await _write(context, frame):
                return False
        return True

    async def _read_credits(self, requests: AsyncIterator[pb.StreamRequest], ready: asyncio.Queue,
                            jobs: set[asyncio.Task], state: dict[str, Any]) -> None:
        coords: Coordinates | None = None
        meta: DatasetMeta | None = None
        try:
            async for req in requests:
                for name in req.released:
                    batch = state["lent"].pop(name, None)
                    if batch is not None:
                        self._pool.release(batch)
                if req.compression and coords is None:
                    state["zstd"] = _compressor(req.compression)
                if req.HasField("shm_probe") and coords is None and self._settings.shared_memory:
                    state["shm"] = _shm.same_host(req.shm_probe.name, req.shm_probe.token)
                if (req.data_socket and coords is None and not state["shm"]
                        and not state["token"] and self.data_sockets is not None):
                    state["token"], state["sock_wait"] = self.data_sockets.expect()
                    ready.put_nowait(encode_socket_offer(self.data_sockets.port,
                                                         state["token"]))
                if req.HasField("coordinates"):
                    coords, meta = self._coordinates(req.coordinates)
                    if coords.dataset != state["dataset"]:  # counted under its dataset
                        if state["dataset"] is not None:
                            self.metrics.streams.labels(state["dataset"]).dec()
                        self.metrics.streams.labels(coords.dataset).inc()
                        state["dataset"] = coords.dataset
                if req.HasField("report") and state["dataset"] is not None:
                    self.metrics.client_report(state["id"], state["dataset"],
                                               req.report.wait_seconds, req.report.loop_seconds)
                if req.batch_indices and coords is None:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 "coordinates: required in the first message of a stream")
                n = state["outstanding"] + len(req.batch_indices)
                if n > self._settings.max_credits:
                    raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"batch_indices: {n} credits outstanding, this server allows "
                                 f"max_credits={self._settings.max_credits} per stream")
                for index in req.batch_indices:
                    assert coords is not None and meta is not None
                    try:
                        # In a thread: a new epoch's permutation of a large dataset takes a
                        # while, and every other stream shares this event loop.
                        indices, ahead = await asyncio.to_thread(
                            self._samples, meta, coords, index)
                    except CoordinateError as e:
                        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
                    state["outstanding"] += 1
                    if self.draining:  # finish what was asked before, take nothing new
                        ready.put_nowait(_Failed(index, coords.epoch, grpc.StatusCode.UNAVAILABLE,
                                                 f"batch {index}: server draining, ask another"))
                        continue
                    job = asyncio.create_task(self._build(coords, index, indices, ahead, ready))
                    jobs.add(job)
                    job.add_done_callback(jobs.discard)
        except _Abort as e:
            ready.put_nowait(e)
            return
        except Exception as e:  # a bug here must end the stream, not leave it waiting
            log.exception("stream reader failed")
            ready.put_nowait(_Abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))
            return
        state["eof"] = True
        ready.put_nowait(None)

    def _samples(self, meta: DatasetMeta, coords: Coordinates, index: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Batch `index`'s samples, and those of the batch `lookahead` further on, which the
        workers fetch from storage ahead of time."""
        indices = batch_samples(meta.ordering, coords, index)
        later = index + self._lookahead
        if later < batches_per_epoch(meta.num_samples, coords):
            return indices, batch_samples(meta.ordering, coords, later)
        return indices, indices[:0]

    async def _build(self, coords: Coordinates, index: int, indices: np.ndarray,
                     ahead: np.ndarray, ready: asyncio.Queue) -> None:
        try:
            fut = self._pool.submit(coords.dataset, indices, ahead,
                                    EpochKey(coords.seed, coords.epoch, coords.shuffle))
            try:
                batch: BuiltBatch = await asyncio.wrap_future(fut)
            except asyncio.CancelledError:
                # Built just as the stream went away: nobody else will free it.
                if not fut.cancel() and fut.exception() is None:
                    self._pool.release(fut.result())
                raise
        except BatchFailed as e:
            ready.put_nowait(_Failed(index, coords.epoch, _FAILURE_CODE[e.kind],
                                     f"batch {index}: {e}"))
            return
        self.metrics.built(coords.dataset, batch.build_seconds, batch.skipped, batch.cache)
        ready.put_nowait((batch, index, coords.epoch))
