"""How one stream's batches reach its client: one `Transport` per stream, chosen once.

The handshake is the stream's first message(s), up to the first with coordinates: what they ask
for (shm_probe, data_socket, compression) is gathered in a `Handshake`, and `choose` turns it
into the stream's transport, which then carries every batch of the stream. The variants, side
by side:

- frames (frames.py): the payload in gRPC frames of `frame_bytes`, zstd-compressed if asked;
- shm (shm.py): one header frame; the client, on the same host, maps the worker's segment;
- data connection (datasocket.py): every answer as a record (header, payload) on a TCP (or
  TLS) connection beside the stream, or by another transport if the client cannot connect.

A new transport is a module here implementing `Transport`, and one more branch in `choose`.

Threading contract: a transport belongs to one stream and runs on the server's event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

if TYPE_CHECKING:
    from ...pool.layout import BuiltBatch
    from ...pool.shm import ReadMappings
    from ...pool.workers import WorkerPool
    from .datasocket import SocketOffer

__all__ = ["Handshake", "Transport", "choose", "write"]


class Transport(Protocol):
    """Sends a stream's batches. `send` owns the batch it is given: it hands the batch back
    to the pool once sent (or once the client has gone), or lends it to the client until
    `returned`; `close` gives back whatever is still lent."""

    # How this stream's batches travel, the `transport` label of metrics: "frames" (gRPC
    # frames), "data_socket" (the payload on the data socket), "shm" (lent in shared memory).
    label: str = "frames"

    async def send(self, context: grpc.aio.ServicerContext, batch: BuiltBatch,
                   batch_index: int, epoch: int) -> bool:
        """Send one batch; False if the client went away (the stream then ends)."""
        ...

    # Whether send_many takes several batches at once (else the sender sends one by one).
    sends_many: bool = False

    async def send_many(self, context: grpc.aio.ServicerContext,
                        batches: list[tuple[BuiltBatch, int, int]]) -> bool:
        """Send several batches (batch, batch index, epoch) in order, owning all of them as
        `send` owns one, cancelled or not; False if the client went away. Only where
        `sends_many`."""
        raise NotImplementedError

    async def send_frame(self, context: grpc.aio.ServicerContext, frame: bytes) -> bool:
        """Send an answer that carries no payload (a batch's error), on the path this
        transport's batches take; False if the client went away."""
        return await write(context, frame)

    def returned(self, shm_name: str) -> None:
        """The client is done with a lent batch (a name in `StreamRequest.released`); a name
        this transport did not lend is ignored."""

    def close(self) -> None:
        """The stream has ended: give back what the client still holds."""


@dataclass
class Handshake:
    """What a client asked for before its coordinates (read by the stream's reader)."""

    zstd: bool = False  # compression="zstd"
    same_host: bool = False  # its shm probe passed, and this server lends shared memory
    offer: SocketOffer | None = None  # a data socket offered (its first frame is sent)


def choose(asked: Handshake, pool: WorkerPool, mappings: ReadMappings,
           frame_bytes: int) -> Transport:
    """The transport of a stream whose handshake asked for `asked`. A data socket offered
    wins (its client may already be connecting); it falls back to the one chosen without it."""
    direct: Transport
    if asked.same_host:
        from .shm import ShmTransport

        direct = ShmTransport(pool)
    else:
        from .frames import FramesTransport, zstd_compressor

        direct = FramesTransport(pool, mappings, frame_bytes,
                                 zstd_compressor() if asked.zstd else None)
    if asked.offer is not None:
        from .datasocket import SocketTransport

        return SocketTransport(asked.offer, pool, mappings, fallback=direct)
    return direct


async def write(context: grpc.aio.ServicerContext, frame: bytes) -> bool:
    """Send one frame; False if the client has gone (cancelled, disconnected)."""
    try:
        await context.write(frame)
    except Exception:
        if context.cancelled() or context.done():
            return False
        raise
    return True
