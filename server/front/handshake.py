"""A stream's handshake: its messages up to the first with coordinates. What they ask of the
transport (compression, a shared-memory probe, a data socket) is gathered in a
`transports.Handshake`; the first coordinates that pass the check settle it: the stream's
transport is chosen, and its initial metadata carries the dataset's fingerprint. (Coordinates
that fail the check end the call, their fingerprint in its trailers: see
DataService.coordinates.)

Threading contract: a StreamHandshake belongs to one stream and runs in its reader, on the
server's one asyncio loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from stoker.v1.wire import FINGERPRINT_KEY

from ..pool import shm
from .ready import Accepted, Offer
from .refusal import Abort
from .transports import Handshake, Transport, choose
from .transports.datasocket import SocketOffer

if TYPE_CHECKING:
    import asyncio

    from stoker.v1 import stoker_pb2 as pb

    from ..pool.workers import DatasetMeta
    from .grants import Grant
    from .limits import HeldPool
    from .ready import Ready
    from .session_context import SessionContext


class StreamHandshake:
    """The handshake of one stream, whose sender takes `ready`'s items."""

    def __init__(self, front: SessionContext, ready: asyncio.Queue[Ready],
                 grant: Grant) -> None:
        self._front = front
        self._grant = grant  # the data connection must prove the same credential
        self._ready = ready
        self.asked = Handshake()

    def ask(self, req: pb.StreamRequest) -> SocketOffer | None:
        """What a message before the coordinates asks of the stream's transport; the data
        socket it made this server offer (at most once a stream), if it did."""
        front, asked = self._front, self.asked
        if req.compression:
            if req.compression != "zstd":
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"compression: {req.compression!r} is not offered; "
                            "this server offers 'zstd'")
            asked.zstd = True
        if req.HasField("shm_probe") and front.settings.shared_memory:
            asked.same_host = shm.same_host(req.shm_probe.name, req.shm_probe.token)
        # A saturated data port (MAX_CLAIMS claims waiting, from many addresses) is not
        # offered: the stream gets frames at once, not after SOCKET_WAIT for a connection
        # that a stranger's may evict. On the same host a plain data connection is offered
        # too, and wins over shared memory: shared memory names each batch in a gRPC
        # message and its release in another, some 50 futex calls a batch on the client
        # between gRPC's threads, against a few system calls a batch on the connection
        # (half the client's CPU a batch at 1 and at 16 MiB, issue 41). Shared memory stays
        # the fallback, and the transport under TLS (no bytes to encrypt).
        sockets = front.data_sockets
        if (req.data_socket and asked.offer is None and sockets is not None
                and not sockets.saturated and not (asked.same_host and sockets.tls)):
            asked.offer = SocketOffer(sockets, self._grant)
            self._ready.put_nowait(Offer(asked.offer.frame))
            return asked.offer
        return None

    def settle(self, meta: DatasetMeta, pool: HeldPool
               ) -> tuple[Transport, tuple[tuple[str, str], ...] | None]:
        """The first coordinates passed (of a dataset with `meta`): the stream's transport,
        lending `pool`'s batches, and its initial metadata (None: none to send)."""
        front = self._front
        transport = choose(self.asked, pool, front.mappings, front.settings.frame_bytes)
        metadata = None
        if meta.fingerprint is not None:
            metadata = ((FINGERPRINT_KEY, meta.fingerprint.digest),)
        self._ready.put_nowait(Accepted())
        return transport, metadata
