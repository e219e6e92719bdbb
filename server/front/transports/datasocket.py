"""The data connection: every answer of a stream on a TCP connection of its own.

The connection is the stream's own, claimed with the token of a `SocketOffer` (the listener
and the claiming are in server/front/data_listener.py). Once it is there, each answer is one
record on it (its layout: stoker.v1.wire): a 4-byte little-endian length, the BatchFrame (no
`data`), and for a batch (`via_socket`) its payload straight from the worker's shared memory,
no copy in Python. No gRPC message per batch: the gRPC stream carries the offer and, at its
end, the call's status.

Plain TCP is sent on the event loop (`sendmsg` of the record's head and payload, waiting for
room when the socket buffer is full); TLS on a thread of the stream's own (SSL_write
encrypts from shared memory with the GIL released, and blocks; the loop goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc

from stoker.v1.wire import RECORD_LENGTH

from ..frame_encoding import encode_socket_frame, encode_socket_offer
from ..grants import OPEN, Grant
from .base import BatchOwner, Transport, write

if TYPE_CHECKING:
    from ...pool.layout import BuiltBatch
    from ...pool.shm import ReadMappings
    from ..data_listener import DataSockets

log = logging.getLogger("stoker.server")

# Seconds a stream waits for the data connection its client asked for before sending in
# frames instead. A client of this version says at once when it cannot connect
# (StreamRequest.data_socket_unreachable): this bound is for one that never says.
SOCKET_WAIT = 5.0


class SocketOffer:
    """A data connection offered to one stream: a token good for one connection, and the
    frame that tells the client where to connect. Made once per stream, when the client
    asks; closed when the stream ends, which refuses a connection that comes later."""

    def __init__(self, sockets: DataSockets, grant: Grant = OPEN) -> None:
        self._sockets = sockets
        # The claim must prove the stream's own credential: its bearer token's proof, or
        # (mutual TLS) the same certificate identity.
        self._token, self._connection = sockets.expect(grant)
        self.credits = sockets.credits  # the stream reads credits on the connection
        self.frame = encode_socket_offer(sockets.port, self._token, grant.token is not None,
                                         self.credits)

    async def connection(self) -> socket.socket | None:
        """The client's connection; None if the client said it cannot connect, or did not
        within SOCKET_WAIT (the token is then forgotten)."""
        try:
            async with asyncio.timeout(SOCKET_WAIT):
                return await asyncio.shield(self._connection)
        except TimeoutError:
            self._sockets.forget(self._token)
            return None

    async def claimed(self) -> socket.socket | None:
        """The client's connection once claimed, however long that takes; None if it never
        is (connection() gave up, or the client cannot connect). Unlike connection(), forgets
        nothing: for a second waiter beside the sender's."""
        try:
            return await asyncio.shield(self._connection)
        except asyncio.CancelledError:
            if self._connection.cancelled():  # forgotten: this waiter was not cancelled
                return None
            raise

    def unreachable(self) -> None:
        """The client cannot reach the data port: frames, at once."""
        self._sockets.unreachable(self._token)

    def close(self) -> None:
        self._sockets.forget(self._token)
        if self._connection.done() and not self._connection.cancelled():
            sock = self._connection.result()
            if sock is not None:
                with contextlib.suppress(OSError):  # a TLS send blocked on it returns
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def _wake(room: asyncio.Future[None]) -> None:
    if not room.done():
        room.set_result(None)


async def _sendmsg_all(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                       buffers: list[memoryview]) -> None:
    """Send every byte of `buffers` on non-blocking `sock`, one sendmsg while they fit, then
    as room frees up. OSError if the connection breaks."""
    views = [b for b in buffers if len(b)]
    while views:
        try:
            n = sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            n = 0
        while n and views:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0
        if views:
            room: asyncio.Future[None] = loop.create_future()
            fd = sock.fileno()
            loop.add_writer(fd, _wake, room)
            try:
                await room
            finally:
                loop.remove_writer(fd)


class SocketTransport(Transport):
    def __init__(self, offer: SocketOffer, pool: BatchOwner, mappings: ReadMappings,
                 fallback: Transport) -> None:
        self._offer = offer
        self._pool = pool
        self._mappings = mappings
        self._fallback = fallback
        self._sock: socket.socket | None = None
        self._instead: Transport | None = None  # the fallback, once the socket did not come
        self._thread: ThreadPoolExecutor | None = None  # sends under TLS

    @property
    def label(self) -> str:  # type: ignore[override]
        # Before its first batch it is the data socket: a client that never connects has that
        # batch counted under it, and the rest under the fallback.
        return self._instead.label if self._instead is not None else "data_socket"

    async def _connected(self, batch: BuiltBatch | None) -> bool:
        """Wait for the client's connection once; True if answers go on it."""
        if self._sock is None and self._instead is None:
            try:
                self._sock = await self._offer.connection()
            except asyncio.CancelledError:
                if batch is not None:
                    self._pool.release(batch)  # the stream ended while it waited
                raise
            if self._sock is None:
                log.warning("a client asked for a data connection and did not connect (it "
                            "could not reach the data port, or waited %.0f s): its batches "
                            "go in gRPC frames", SOCKET_WAIT)
                self._instead = self._fallback
            elif isinstance(self._sock, ssl.SSLSocket):
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="stoker-data-send")
        return self._instead is None

    async def send(self, context: grpc.aio.ServicerContext, batch: BuiltBatch,
                   batch_index: int, epoch: int) -> bool:
        """The batch as one record on the data connection, its payload straight from shared
        memory; False if the client went away. The first answer waits for the client's
        connection; if it never comes, this and every later batch go by the fallback."""
        if not await self._connected(batch):
            assert self._instead is not None
            return await self._instead.send(context, batch, batch_index, epoch)
        try:
            head, payload = self._record(batch, batch_index, epoch)
            try:
                return await self._put(head, payload)
            finally:
                payload.release()
        finally:
            self._pool.release(batch)  # on the wire, or nobody wants it

    def _record(self, batch: BuiltBatch, batch_index: int, epoch: int
                ) -> tuple[bytes, memoryview]:
        """A batch's record: its length and frame, and its payload as a view of the shared
        memory it is in (the caller releases the view)."""
        head = encode_socket_frame(batch, batch_index, epoch)
        segment = self._mappings.get(batch.shm_name, batch.payload_bytes)
        with memoryview(segment) as view:
            return RECORD_LENGTH.pack(len(head)) + head, view[: batch.payload_bytes]

    @property
    def sends_many(self) -> bool:  # type: ignore[override]
        """Once the client's plain TCP connection is there (TLS sends on a thread)."""
        return self._sock is not None and self._thread is None

    async def send_many(self, context: grpc.aio.ServicerContext,
                        batches: list[tuple[BuiltBatch, int, int]]) -> bool:
        """Several records in one sendmsg (plain TCP): one system call, and one wake-up of
        the client, for the batches that became ready together."""
        assert self._sock is not None
        views: list[memoryview] = []
        try:
            for batch, batch_index, epoch in batches:
                head, payload = self._record(batch, batch_index, epoch)
                views += (memoryview(head), payload)
            try:
                await _sendmsg_all(asyncio.get_running_loop(), self._sock, views)
            except OSError:
                return False
            return True
        finally:
            for v in views:
                v.release()
            for batch, _, _ in batches:
                self._pool.release(batch)

    async def send_frame(self, context: grpc.aio.ServicerContext, frame: bytes) -> bool:
        """An answer without payload (a batch's error), in order with the batches."""
        if not await self._connected(None):
            return await write(context, frame)
        return await self._put(RECORD_LENGTH.pack(len(frame)) + frame, memoryview(b""))

    async def _put(self, head: bytes, payload: memoryview) -> bool:
        """`head` then `payload` on the connection; False if it broke (the stream then ends:
        the client fails over)."""
        sock, loop = self._sock, asyncio.get_running_loop()
        assert sock is not None
        try:
            if self._thread is None:
                await _sendmsg_all(loop, sock, [memoryview(head), payload])
                return True

            def put() -> None:
                sock.sendall(head)
                if len(payload):
                    sock.sendall(payload)

            sent = loop.run_in_executor(self._thread, put)
            try:
                await asyncio.shield(sent)
            except asyncio.CancelledError:
                # The thread reads `payload`, in a segment the caller is about to hand back:
                # break the connection, and wait until the thread has let go of it.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(Exception):
                    await sent
                raise
        except OSError:
            return False  # the client closed its connection: the stream ends too
        return True

    def returned(self, shm_name: str) -> None:
        self._fallback.returned(shm_name)

    def close(self) -> None:
        self._fallback.close()  # the offer and its connection: the stream closes them
        if self._thread is not None:
            self._thread.shutdown(wait=False)
