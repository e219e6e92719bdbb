"""One StreamBatches call, from its first message to its last frame.

Two coroutines serve a stream. The reader (`read_credits`, and `_read_socket_credits` for
credits on the data connection) reads the client's messages: the handshake (up to the first
with coordinates: server/front/handshake.py), then credits (server/front/credits.py),
releases and reports. The sender (server/front/sender.py) writes what becomes ready, in the
order it does, by the transport the handshake chose. They talk through the ready queue, whose
items are in server/front/ready.py, and share the stream's credits (`Credits.outstanding`:
the reader counts up, the sender down) and its transport (set once by the reader, before any
credit). The stream's metrics and log lines are counted in server/front/stream_stats.py.

Threading contract: everything here runs on the server's one asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from stoker.v1 import stoker_pb2 as pb
from stoker.v1.wire import CreditCountError, decode_credits

from .credits import Credits
from .grants import OPEN, Grant
from .handshake import StreamHandshake
from .limits import HeldPool
from .ready import Finished, Ready, ReadyBatch, RefusedCall
from .redact import redact
from .refusal import Abort
from .sender import Sender
from .stream_stats import StreamStats

if TYPE_CHECKING:
    from ..order.sampling import Coordinates
    from ..pool.workers import DatasetMeta
    from .session_context import SessionContext
    from .transports.datasocket import SocketOffer

log = logging.getLogger("stoker.server")

_READ = 1 << 16  # bytes read from the data connection at once


class StreamSession:
    """One batch stream. Made per StreamBatches call by the DataService, with the front end's
    parts it reads (`front`, the same for every stream); `run` serves it, and `close`
    (always awaited after `run`) frees what it held."""

    def __init__(self, front: SessionContext, context: grpc.aio.ServicerContext,
                 stream_id: int, client: str = "", grant: Grant = OPEN) -> None:
        self._front = front
        self._grant = grant  # the caller's: which datasets its coordinates may name
        self.id = stream_id
        # Built batches count against `client` in the Admission from the moment they arrive
        # until they go back to the pool, which the transport and close() do through this
        # view of it.
        self._pool = HeldPool(front.shared, front.admission, client)
        self._ready: asyncio.Queue[Ready] = asyncio.Queue()
        self._stats = StreamStats(front.metrics, stream_id, context.peer())
        self._credits = Credits(front, client, self._ready, context.peer())
        self._handshake = StreamHandshake(front, self._ready, grant)
        self._sender = Sender(context, self._ready, self._credits, self._stats,
                              redact if front.settings.redact_paths else str)
        self._reader: asyncio.Task | None = None
        self._socket_reader: asyncio.Task | None = None  # credits on the data connection
        # Credits from gRPC and the data connection are taken one message at a time.
        self._crediting = asyncio.Lock()
        self._coords: Coordinates | None = None  # the latest coordinates accepted
        self._meta: DatasetMeta | None = None  # of the latest coordinates accepted
        self._offer: SocketOffer | None = None  # the data socket offered, at most once

    async def run(self, requests: AsyncIterator[pb.StreamRequest]) -> None:
        """Serve the stream: read the client's messages, and send until every credit is
        answered after the client half-closes, or until the client goes away (Sender.run)."""
        self._reader = asyncio.create_task(self.read_credits(requests))
        await self._sender.run()

    async def close(self) -> None:
        """Free what the stream still holds, in steps."""
        # 1. Stop reading credits and building; a build that completes now is released by
        #    Credits._build itself.
        tasks = [t for t in (self._reader, self._socket_reader, *self._credits.jobs)
                 if t is not None]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        # 2. Batches built but not sent.
        pool = self._pool
        while not self._ready.empty():
            match self._ready.get_nowait():
                case ReadyBatch(batch):
                    pool.release(batch)
        # 3. What the transport still lends (shared memory: unlinked, not reused).
        if self._sender.transport is not None:
            self._sender.transport.close()
        # 4. The data socket: its token forgotten, its connection closed.
        if self._offer is not None:
            self._offer.close()
        # 5. Metrics, and the log's line.
        self._stats.closed(draining=self._front.draining())

    # -- the reader ------------------------------------------------------------------------
    async def read_credits(self, requests: AsyncIterator[pb.StreamRequest]) -> None:
        """Read the client's messages until it half-closes; a refused request ends the
        stream (through the sender, the one that writes)."""
        sender, stats = self._sender, self._stats
        coords: Coordinates | None = None
        meta: DatasetMeta | None = None
        try:
            async for req in requests:
                if sender.transport is not None:
                    for name in req.released:
                        sender.transport.returned(name)
                if req.data_socket_unreachable and self._offer is not None:
                    self._offer.unreachable()  # frames at once, not after SOCKET_WAIT
                if coords is None and (offer := self._handshake.ask(req)) is not None:
                    self._offer = offer
                    if offer.credits:
                        self._socket_reader = asyncio.create_task(self._read_socket_credits())
                if req.HasField("coordinates"):
                    coords, meta = self._front.coordinates(req.coordinates, self._grant)
                    self._coords, self._meta = coords, meta
                    stats.accepted(coords)
                    if sender.transport is None:  # the handshake is over
                        sender.transport, sender.metadata = self._handshake.settle(
                            meta, self._pool)
                        stats.opened(sender.transport.label)
                    stats.count_under(coords.dataset)
                if req.HasField("report"):
                    stats.report(req.report)
                if req.batch_indices:
                    if coords is None or meta is None:
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "coordinates: required in the first message of a stream")
                    async with self._crediting:
                        await self._credits.take(coords, meta, req.batch_indices)
        except Abort as e:
            self._ready.put_nowait(RefusedCall(e.code, str(e), e.trailers))
            return
        except Exception as e:  # a bug here must end the stream, not leave it waiting
            log.exception("stream reader failed")
            self._ready.put_nowait(RefusedCall(grpc.StatusCode.INTERNAL,
                                               f"{type(e).__name__}: {e}"))
            return
        self._ready.put_nowait(Finished())

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
        limit = self._front.settings.max_credits
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
                        await self._credits.take(self._coords, self._meta, indices)
        except CreditCountError as e:
            self._ready.put_nowait(RefusedCall(
                grpc.StatusCode.INVALID_ARGUMENT, f"data connection: a credit record of "
                f"{e.count} batch indices (1 to max_credits={limit})"))
        except Abort as e:
            self._ready.put_nowait(RefusedCall(e.code, str(e), e.trailers))
        except OSError:
            pass  # the connection broke: the sender's next write says so
        except Exception as e:  # a bug here must end the stream, not leave it waiting
            log.exception("stream reader (data connection) failed")
            self._ready.put_nowait(RefusedCall(grpc.StatusCode.INTERNAL,
                                               f"{type(e).__name__}: {e}"))
