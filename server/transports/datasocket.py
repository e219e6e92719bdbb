"""The data socket: each batch's header in a frame, its payload on a plain TCP connection.

The connection is the stream's own, claimed with the token of a `SocketOffer` (the listener
and the claiming are in server/_datasocket.py). Payloads go straight from the worker's shared
memory (`loop.sock_sendall`, no copy in Python), in the order of their header frames.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

import grpc

from .._frames import encode_socket_frame, encode_socket_offer
from . import Transport, write

if TYPE_CHECKING:
    from .._batch import BuiltBatch
    from .._datasocket import DataSockets
    from .._shm import ReadMappings
    from .._workers import WorkerPool

log = logging.getLogger("stoker.server")

# Seconds a stream waits for the data socket its client asked for before sending payloads in
# frames instead (a firewall, a client that could not connect).
SOCKET_WAIT = 5.0


class SocketOffer:
    """A data socket offered to one stream: a token good for one connection, and the frame
    that tells the client where to connect. Made once per stream, when the client asks;
    closed when the stream ends, which refuses a connection that comes later."""

    def __init__(self, sockets: DataSockets) -> None:
        self._sockets = sockets
        self._token, self._connection = sockets.expect()
        self.frame = encode_socket_offer(sockets.port, self._token)

    async def connection(self) -> socket.socket | None:
        """The client's connection; None if it did not come within SOCKET_WAIT (the token
        is then forgotten)."""
        try:
            async with asyncio.timeout(SOCKET_WAIT):
                return await self._connection
        except TimeoutError:
            self._sockets.forget(self._token)
            return None

    def close(self) -> None:
        self._sockets.forget(self._token)
        if self._connection.done() and not self._connection.cancelled():
            self._connection.result().close()


class SocketTransport(Transport):
    def __init__(self, offer: SocketOffer, pool: WorkerPool, mappings: ReadMappings,
                 fallback: Transport) -> None:
        self._offer = offer
        self._pool = pool
        self._mappings = mappings
        self._fallback = fallback
        self._sock: socket.socket | None = None
        self._instead: Transport | None = None  # the fallback, once the socket did not come

    @property
    def label(self) -> str:  # type: ignore[override]
        # Before its first batch it is the data socket: a client that never connects has that
        # batch counted under it, and the rest under the fallback.
        return self._instead.label if self._instead is not None else "data_socket"

    async def send(self, context: grpc.aio.ServicerContext, batch: BuiltBatch,
                   batch_index: int, epoch: int) -> bool:
        """The batch's header as a frame, its payload on the data socket, straight from
        shared memory; False if the client went away. The first batch waits for the client's
        connection; if it never comes, this and every later batch go by the fallback."""
        if self._sock is None and self._instead is None:
            try:
                self._sock = await self._offer.connection()
            except asyncio.CancelledError:
                self._pool.release(batch)  # the stream ended while it waited
                raise
            if self._sock is None:
                log.warning("a client asked for a data socket and did not connect within "
                            "%.0f s: its batches go in frames", SOCKET_WAIT)
                self._instead = self._fallback
        if self._instead is not None:
            return await self._instead.send(context, batch, batch_index, epoch)
        try:
            if not await write(context, encode_socket_frame(batch, batch_index, epoch)):
                return False
            segment = self._mappings.get(batch.shm_name, batch.payload_bytes)
            with memoryview(segment) as view:
                payload = view[: batch.payload_bytes]
                try:
                    await asyncio.get_running_loop().sock_sendall(self._sock, payload)
                except OSError:
                    return False  # the client closed its socket: the stream ends too
                finally:
                    payload.release()
            return True
        finally:
            self._pool.release(batch)  # on the wire, or nobody wants it

    def returned(self, shm_name: str) -> None:
        self._fallback.returned(shm_name)

    def close(self) -> None:
        self._fallback.close()  # the offer and its connection: the stream closes them
