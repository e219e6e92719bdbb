"""What every transport is: the `Transport` protocol, `BatchOwner` (where a sent batch goes
back), and `write`, one frame on the stream. The variants import this module, never the
package that imports them (which holds the `Handshake` that chooses one)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import grpc

if TYPE_CHECKING:
    from ...pool.layout import BuiltBatch


class BatchOwner(Protocol):
    """Where a transport hands a sent batch back: the worker pool, or a view of it
    (front/limits.py's HeldPool, front/shared_batches.py's SharedBatches)."""

    def release(self, batch: BuiltBatch, reuse: bool = True) -> None: ...


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
        raise TypeError(f"{type(self).__name__} sends one batch at a time (sends_many)")

    async def send_frame(self, context: grpc.aio.ServicerContext, frame: bytes) -> bool:
        """Send an answer that carries no payload (a batch's error), on the path this
        transport's batches take; False if the client went away."""
        return await write(context, frame)

    def returned(self, shm_name: str) -> None:
        """The client is done with a lent batch (a name in `StreamRequest.released`); a name
        this transport did not lend is ignored."""
        return None

    def close(self) -> None:
        """The stream has ended: give back what the client still holds."""
        return None


async def write(context: grpc.aio.ServicerContext, frame: bytes) -> bool:
    """Send one frame; False if the client has gone (cancelled, disconnected)."""
    try:
        await context.write(frame)
    except Exception:
        if context.cancelled() or context.done():
            return False
        raise
    return True
