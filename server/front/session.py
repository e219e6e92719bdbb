"""One StreamBatches call, from its first message to its last frame.

Two coroutines serve a stream. `read_credits` reads the client's messages: the handshake (up
to the first with coordinates), then credits, releases and reports; it starts one build per
credit. `run` sends what becomes ready, in the order it does, by the transport the handshake
chose (server/transports). They talk through the ready queue, whose items are the small
dataclasses below, and share two fields: `outstanding` (credits not yet answered: the reader
counts up, the sender down) and `transport` (set once by the reader, before any credit).

Threading contract: everything here runs on the server's one asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np

from stoker.v1 import stoker_pb2 as pb
from stoker.v1.wire import CreditCountError, decode_credits

from ..order.epochs import epoch_size, samples_of
from ..order.sampling import (
    CoordinateError,
    Coordinates,
)
from ..pool import shm
from ..pool.layout import BuiltBatch
from ..pool.workers import BatchFailed, DatasetMeta, FailureKind
from .frames import encode_error
from .limits import HeldPool
from .transports import Handshake, Transport, choose, write
from .transports.datasocket import SocketOffer

if TYPE_CHECKING:
    from .service import DataService

log = logging.getLogger("stoker.server")

_READ = 1 << 16  # bytes read from the data connection at once

# BatchFailed.kind -> the status its batch is answered with.
FAILURE_CODE = {FailureKind.DATA_LOSS: grpc.StatusCode.DATA_LOSS,
                FailureKind.INTERNAL: grpc.StatusCode.INTERNAL,
                FailureKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
                FailureKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE}


# -- the ready queue's items ------------------------------------------------------------------
@dataclass(frozen=True)
class Built:
    """A batch ready to send."""

    batch: BuiltBatch
    batch_index: int
    epoch: int


@dataclass(frozen=True)
class Failed:
    """A batch that could not be built: answered in-band, the stream goes on. `detail`: what
    the server's log says instead of `message` (the full text: paths, the traceback)."""

    batch_index: int
    epoch: int
    code: grpc.StatusCode
    message: str
    detail: str = ""


@dataclass(frozen=True)
class Offer:
    """A frame that answers no credit: the data socket's offer."""

    frame: bytes


@dataclass(frozen=True)
class Refused:
    """The reader refused a request: the call ends with this status."""

    code: grpc.StatusCode
    message: str
    trailers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Accepted:
    """The first coordinates passed: the stream's initial metadata may go out."""


@dataclass(frozen=True)
class Finished:
    """The client half-closed: the stream ends once every credit is answered."""


Ready = Built | Failed | Offer | Refused | Finished | Accepted

# Initial metadata of an accepted stream, trailing metadata of one refused for its data:
# the dataset's fingerprint digest as this server has it.
FINGERPRINT_KEY = "stoker-fingerprint"
# Answers the log warns about, one line each: the client cannot go on, and the operator
# should know why (a bad sample, a limit).
WARNED = (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED)


class Abort(Exception):
    """A request refused with a gRPC status (and `trailers`, trailing metadata): the call
    ends with it."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.trailers = trailers


class StreamSession:
    """One batch stream. Made per StreamBatches call by the DataService, whose pool, metrics,
    settings, mappings and state (`draining`, `data_sockets`) it reads; `run` serves it, and
    `close` (always awaited after `run`) frees what it held."""

    def __init__(self, service: DataService, context: grpc.aio.ServicerContext,
                 stream_id: int, client: str = "") -> None:
        self._service = service
        self._context = context
        self.id = stream_id
        # Built batches count against `client` in the service's Admission from the moment
        # they arrive until they go back to the pool, which the transport and close() do
        # through this view of it.
        self._client = client
        self._pool = HeldPool(service.shared, service.admission, client)
        self._last_payload = 0  # bytes of this stream's last batch: the next one's estimate
        # Coordinates whose epoch order a thread has made (cached in _sampling.ORDERS): later
        # credits under them are sliced on the loop (see _credit).
        self._warm: Coordinates | None = None
        self._ready: asyncio.Queue[Ready] = asyncio.Queue()
        self._reader: asyncio.Task | None = None
        self._socket_reader: asyncio.Task | None = None  # credits on the data connection
        # Credits from gRPC and the data connection are taken one message at a time.
        self._crediting = asyncio.Lock()
        self._meta: DatasetMeta | None = None  # of the latest coordinates accepted
        self._jobs: set[asyncio.Task] = set()  # builds under way
        self.outstanding = 0  # credits not answered yet
        self.transport: Transport | None = None  # chosen with the first coordinates
        self.dataset: str | None = None  # the stream is counted under it in metrics
        self._offer: SocketOffer | None = None  # the data socket offered, at most once
        # Set by the reader when the first coordinates pass; sent by the sender before its
        # first write (a write sends empty initial metadata otherwise).
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._metadata_sent = False
        # For the log's lines about this stream (opened, warned, closed).
        self._peer = context.peer()
        self._coords: Coordinates | None = None  # the latest coordinates accepted
        self._epochs: tuple[int, int] | None = None  # the first and last epoch asked for
        self._sent = self._failed = 0  # batches sent, batches answered with an error
        self._opened = time.monotonic()
        self._ended = ""  # why the stream ended, once the sender knows

    # -- the sender ------------------------------------------------------------------------
    async def run(self, requests: AsyncIterator[pb.StreamRequest]) -> None:
        """Answer every credited batch index once, in the order batches become ready.

        Ends when the client half-closes and every credit is answered, or when the client
        goes away. Writes go through context.write, not a generator: a write that fails
        because the client went away then ends the call quietly instead of logging a
        traceback."""
        self._reader = asyncio.create_task(self.read_credits(requests))
        context, metrics = self._context, self._service.metrics
        finished = False
        gone = "the client went away"
        ready = self._ready
        after: Ready | None = None  # taken from the queue behind batches sent together
        while not (finished and self.outstanding == 0):
            item, after = (after, None) if after is not None else (await ready.get(), None)
            if not await self._send_metadata(writes=isinstance(item, Built | Failed | Offer)):
                self._ended = gone
                return
            match item:
                case Built(batch, batch_index, epoch):
                    transport = self.transport
                    assert transport is not None and self.dataset is not None
                    # Batches that became ready together go out together where the
                    # transport can (one sendmsg: one system call, one wake-up of the client).
                    together = [item]
                    while transport.sends_many and not ready.empty():
                        more = ready.get_nowait()
                        if not isinstance(more, Built):
                            after = more
                            break
                        together.append(more)
                    # A credit counts as answered once its batch starts out: the client may
                    # send the next credit as soon as it has the last frame.
                    self.outstanding -= len(together)
                    for b in together:
                        metrics.sent(self.dataset, b.batch.num_samples, b.batch.payload_bytes,
                                     transport.label)
                    self._sent += len(together)
                    if not await (transport.send(context, batch, batch_index, epoch)
                                  if len(together) == 1 else transport.send_many(
                                      context, [(b.batch, b.batch_index, b.epoch)
                                                for b in together])):
                        self._ended = gone
                        return
                case Failed(batch_index, epoch, code, message, detail):
                    self.outstanding -= 1
                    self._failed += 1
                    metrics.errors.labels(self.dataset, code.name.lower()).inc()
                    if code in WARNED:
                        log.warning("%s: batch %d of epoch %d answered %s: %s", self._who(),
                                    batch_index, epoch, code.name, detail or message)
                    frame = encode_error(batch_index, epoch, code.value[0], message)
                    if not await (self.transport.send_frame(context, frame) if self.transport
                                  else write(context, frame)):
                        self._ended = gone
                        return
                case Offer(frame):
                    if not await write(context, frame):
                        self._ended = gone
                        return
                case Refused(code, message, trailers):
                    self._ended = f"refused, {code.name}: {message}"
                    if code in WARNED:
                        log.warning("%s: refused, %s: %s", self._who(), code.name, message)
                    await context.abort(code, message, trailing_metadata=trailers)
                case Finished():
                    finished = True
                case Accepted():
                    pass  # its metadata went out above
        self._ended = "the client finished it"

    async def _send_metadata(self, writes: bool) -> bool:
        """Send the stream's initial metadata if the coordinates are accepted and it has not
        gone yet (`writes`: a frame follows, which sends empty initial metadata if none went
        before it); False if the client has gone."""
        if self._metadata_sent:
            return True
        if self._metadata is None:
            self._metadata_sent = writes  # after a frame it is too late
            return True
        self._metadata_sent = True
        try:
            await self._context.send_initial_metadata(self._metadata)
        except Exception:  # the client went away: the call ends quietly, as a failed write
            return False
        return True

    async def close(self) -> None:
        """Free what the stream still holds, in steps."""
        # 1. Stop reading credits and building; a build that completes now is released by
        #    _build itself.
        tasks = [t for t in (self._reader, self._socket_reader, *self._jobs) if t is not None]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        # 2. Batches built but not sent.
        pool = self._pool
        while not self._ready.empty():
            match self._ready.get_nowait():
                case Built(batch):
                    pool.release(batch)
        # 3. What the transport still lends (shared memory: unlinked, not reused).
        if self.transport is not None:
            self.transport.close()
        # 4. The data socket: its token forgotten, its connection closed.
        if self._offer is not None:
            self._offer.close()
        # 5. Metrics, and the log's line.
        metrics = self._service.metrics
        if self.dataset is not None:
            metrics.streams.labels(self.dataset).dec()
        metrics.stream_ended(self.id)
        why = self._ended or ("cut by the server's shutdown" if self._service.draining
                              else "the client cancelled it (closed its loader, or went away)")
        log.info("%s closed after %.1f s: %d batches sent, %d failed; %s", self._who(),
                 time.monotonic() - self._opened, self._sent, self._failed, why)

    def _who(self) -> str:
        """`stream 7 from ipv4:10.0.0.5:41234 (dataset 'faces', rank 0/8, epoch 3)`, or
        `..., epoch 3 from position 4096)` for coordinates with a start."""
        c, epochs = self._coords, self._epochs
        if c is None or epochs is None:
            return f"stream {self.id} from {self._peer}"
        epoch = f"epoch {epochs[0]}" if epochs[0] == epochs[1] else \
            f"epochs {epochs[0]}-{epochs[1]}"
        if c.start:  # an epoch resumed at another world_size or batch_size
            epoch += f" from position {c.start}"
        return (f"stream {self.id} from {self._peer} (dataset {c.dataset!r}, "
                f"rank {c.rank}/{c.world_size}, {epoch})")

    # -- the reader ------------------------------------------------------------------------
    async def read_credits(self, requests: AsyncIterator[pb.StreamRequest]) -> None:
        """Read the client's messages until it half-closes; a refused request ends the
        stream (through the sender, the one that writes)."""
        service, metrics = self._service, self._service.metrics
        asked = Handshake()
        coords: Coordinates | None = None
        meta: DatasetMeta | None = None
        try:
            async for req in requests:
                if self.transport is not None:
                    for name in req.released:
                        self.transport.returned(name)
                if req.data_socket_unreachable and self._offer is not None:
                    self._offer.unreachable()  # frames at once, not after SOCKET_WAIT
                if coords is None:
                    self._handshake(req, asked)
                if req.HasField("coordinates"):
                    coords, meta = service.coordinates(req.coordinates)
                    self._coords, self._meta = coords, meta
                    self._epochs = (coords.epoch if self._epochs is None else self._epochs[0],
                                    coords.epoch)
                    if self.transport is None:  # the handshake is over
                        self.transport = choose(asked, self._pool, service.mappings,
                                                service.settings.frame_bytes)
                        if meta.fingerprint is not None:
                            self._metadata = ((FINGERPRINT_KEY, meta.fingerprint.digest),)
                        self._ready.put_nowait(Accepted())
                        log.info("%s opened, by %s, %s", self._who(), self.transport.label,
                                 f"batch_tokens {coords.batch_tokens} ({coords.token_cost})"
                                 if coords.batch_tokens else f"batch_size {coords.batch_size}")
                    if coords.dataset != self.dataset:  # counted under its dataset
                        if self.dataset is not None:
                            metrics.streams.labels(self.dataset).dec()
                        metrics.streams.labels(coords.dataset).inc()
                        self.dataset = coords.dataset
                if req.HasField("report") and self.dataset is not None:
                    metrics.client_report(self.id, self.dataset, req.report.wait_seconds,
                                          req.report.loop_seconds)
                if req.batch_indices:
                    if coords is None or meta is None:
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "coordinates: required in the first message of a stream")
                    async with self._crediting:
                        await self._credit(coords, meta, req.batch_indices)
        except Abort as e:
            self._ready.put_nowait(Refused(e.code, str(e), e.trailers))
            return
        except Exception as e:  # a bug here must end the stream, not leave it waiting
            log.exception("stream reader failed")
            self._ready.put_nowait(Refused(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))
            return
        self._ready.put_nowait(Finished())

    def _handshake(self, req: pb.StreamRequest, asked: Handshake) -> None:
        """What a message before the coordinates asks of the stream's transport."""
        service = self._service
        if req.compression:
            if req.compression != "zstd":
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"compression: {req.compression!r} is not offered; "
                            "this server offers 'zstd'")
            asked.zstd = True
        if req.HasField("shm_probe") and service.settings.shared_memory:
            asked.same_host = shm.same_host(req.shm_probe.name, req.shm_probe.token)
        if (req.data_socket and not asked.same_host and self._offer is None
                and service.data_sockets is not None):
            self._offer = asked.offer = SocketOffer(service.data_sockets)
            self._ready.put_nowait(Offer(self._offer.frame))
            if self._offer.credits:
                self._socket_reader = asyncio.create_task(self._read_socket_credits())

    async def _read_socket_credits(self) -> None:
        """Credits the client sends on the data connection (plain TCP): records of a count
        and that many batch indices, taken like a StreamRequest's batch_indices under the
        stream's latest coordinates. Saves a gRPC message per credit at both ends (the
        client's request thread, this loop's decoding of it). A bad record ends the stream
        as a bad StreamRequest does; the connection's end ends only this reader (the
        sender finds out by itself)."""
        assert self._offer is not None
        sock = await self._offer.claimed()
        if sock is None:
            return
        loop = asyncio.get_running_loop()
        limit = self._service.settings.max_credits
        pending = b""
        try:
            while more := await loop.sock_recv(sock, _READ):
                pending += more
                while (record := decode_credits(pending, limit)) is not None:
                    indices, end = record
                    pending = pending[end:]
                    if self._coords is None or self._meta is None:
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "coordinates: required in the first message of a stream")
                    async with self._crediting:
                        await self._credit(self._coords, self._meta, indices)
        except CreditCountError as e:
            self._ready.put_nowait(Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"data connection: a credit record of "
                f"{e.count} batch indices (1 to max_credits={limit})"))
        except Abort as e:
            self._ready.put_nowait(Refused(e.code, str(e), e.trailers))
        except OSError:
            pass  # the connection broke: the sender's next write says so
        except Exception as e:  # a bug here must end the stream, not leave it waiting
            log.exception("stream reader (data connection) failed")
            self._ready.put_nowait(Refused(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))

    async def _credit(self, coords: Coordinates, meta: DatasetMeta,
                      batch_indices: list[int]) -> None:
        """Start building each credited batch (or, draining or over a held-memory limit,
        answer it UNAVAILABLE)."""
        n = self.outstanding + len(batch_indices)
        limit = self._service.settings.max_credits
        if n > limit:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"batch_indices: {n} credits outstanding, this server allows "
                        f"max_credits={limit} per stream")
        try:
            if coords == self._warm:
                # This epoch's order is made and cached: slicing it is microseconds, less
                # than the hop to a thread and back (about a fifth of the loop's time per
                # batch at 64 KiB batches). An order the cache has dropped since is made
                # again here, on the loop: rare (the cache holds max_order_cache_bytes).
                samples = [self._samples(meta, coords, index) for index in batch_indices]
            else:
                # In a thread: a new epoch's permutation of a large dataset takes a while,
                # and every other stream shares this event loop. One hop for the message.
                samples = await asyncio.to_thread(
                    lambda: [self._samples(meta, coords, index) for index in batch_indices])
                self._warm = coords
        except CoordinateError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        for index, (indices, ahead) in zip(batch_indices, samples, strict=True):
            self.outstanding += 1
            if self._service.draining:  # finish what was asked before, take nothing new
                self._ready.put_nowait(Failed(index, coords.epoch, grpc.StatusCode.UNAVAILABLE,
                                              f"batch {index}: server draining, ask another"))
                continue
            # No room for a batch like the last one: not built at all (_build checks the
            # batch itself, exactly, once built).
            if (why := self._service.admission.over(self._client, self._last_payload)):
                self._ready.put_nowait(Failed(index, coords.epoch, grpc.StatusCode.UNAVAILABLE,
                                              f"batch {index}: {why}"))
                continue
            job = asyncio.create_task(self._build(coords, index, indices, ahead))
            self._jobs.add(job)
            job.add_done_callback(self._jobs.discard)

    def _samples(self, meta: DatasetMeta, coords: Coordinates, index: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Batch `index`'s samples, and those of the batch `lookahead` further on, which the
        workers fetch from storage ahead of time."""
        indices = samples_of(meta, coords, index)
        later = index + self._service.lookahead
        if meta.prefetches and later < epoch_size(meta, coords)[0]:
            return indices, samples_of(meta, coords, later)
        return indices, indices[:0]

    async def _build(self, coords: Coordinates, index: int, indices: np.ndarray,
                     ahead: np.ndarray) -> None:
        # Shared with every stream that asks for the same batch (server/front/shared_batches.py);
        # this stream holds its reference from here on, released like any batch.
        pool = self._service.shared
        try:
            batch, _ = await pool.get(coords, index, indices, ahead)
        except BatchFailed as e:
            self._ready.put_nowait(Failed(index, coords.epoch, FAILURE_CODE[e.kind],
                                          f"batch {index}: {e}", e.detail))
            return
        admission = self._service.admission
        if (why := admission.over(self._client, batch.payload_bytes)):
            pool.release(batch)  # never held: back to its worker at once
            self._ready.put_nowait(Failed(index, coords.epoch, grpc.StatusCode.UNAVAILABLE,
                                          f"batch {index}: {why}"))
            return
        admission.hold(self._client, batch.payload_bytes)
        self._last_payload = batch.payload_bytes
        self._ready.put_nowait(Built(batch, index, coords.epoch))
