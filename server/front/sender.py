"""A stream's sender: the one coroutine that writes to the call. It answers what the ready
queue hands it, in that order, by the transport the handshake chose (server/transports), and
ends the call when the reader refused a request or the client finished.

Threading contract: a Sender belongs to one stream and runs on the server's one asyncio loop.
`transport` and `metadata` are set once by the stream's reader, with the first coordinates,
before any credit; the sender counts the stream's credits down as it answers them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from .frame_encoding import encode_error
from .ready import Accepted, FailedBatch, Finished, Offer, Ready, ReadyBatch, RefusedCall
from .transports import Transport, write

if TYPE_CHECKING:
    import grpc

    from .credits import Credits
    from .stream_stats import StreamStats

# Why a stream ended when a write finds the client gone (StreamStats.ended).
GONE = "the client went away"


class Sender:
    """Writes one stream's answers to its call (`context`)."""

    def __init__(self, context: grpc.aio.ServicerContext, ready: asyncio.Queue[Ready],
                 credits: Credits, stats: StreamStats,
                 redact: Callable[[str], str] = str) -> None:
        self._context = context
        # What an error message the client is told goes through (server.redact_paths).
        self._redact = redact
        self._ready = ready
        self._credits = credits
        self._stats = stats
        self.transport: Transport | None = None  # chosen with the first coordinates
        # Set by the reader when the first coordinates pass; sent before the first write
        # (a write sends empty initial metadata otherwise).
        self.metadata: tuple[tuple[str, str], ...] | None = None
        self._metadata_sent = False
        self._finished = False  # the client half-closed

    async def run(self) -> None:
        """Answer every credited batch index once, in the order batches become ready.

        Ends when the client half-closes and every credit is answered, or when the client
        goes away. Writes go through context.write, not a generator: a write that fails
        because the client went away then ends the call quietly instead of logging a
        traceback."""
        ready = self._ready
        after: Ready | None = None  # taken from the queue behind batches sent together
        while not (self._finished and self._credits.outstanding == 0):
            item, after = (after, None) if after is not None else (await ready.get(), None)
            writes = isinstance(item, ReadyBatch | FailedBatch | Offer)
            if not await self._send_metadata(writes):
                self._stats.ended = GONE
                return
            if isinstance(item, ReadyBatch):
                transport = self.transport
                assert transport is not None
                # Batches that became ready together go out together where the transport
                # can (one sendmsg: one system call, one wake-up of the client).
                together = [item]
                while transport.sends_many and not ready.empty():
                    more = ready.get_nowait()
                    if not isinstance(more, ReadyBatch):
                        after = more
                        break
                    together.append(more)
                sent = await self._send_batches(transport, together)
            else:
                sent = await self._answer(item)
            if not sent:
                self._stats.ended = GONE
                return
        self._stats.ended = "the client finished it"

    async def _send_batches(self, transport: Transport, together: list[ReadyBatch]) -> bool:
        """Send batches ready together; False if the client has gone."""
        context = self._context
        # A credit counts as answered once its batch starts out: the client may send the
        # next credit as soon as it has the last frame.
        self._credits.answered(len(together))
        self._stats.sent(together, transport.label)
        if len(together) == 1:
            b = together[0]
            return await transport.send(context, b.batch, b.batch_index, b.epoch)
        return await transport.send_many(
            context, [(b.batch, b.batch_index, b.epoch) for b in together])

    async def _answer(self, item: Ready) -> bool:
        """Answer what is not a batch; False if the client has gone."""
        context = self._context
        match item:
            case FailedBatch(batch_index, epoch, code, message):
                self._credits.answered(1)
                self._stats.failed(item)
                frame = encode_error(batch_index, epoch, code.value[0],
                                     self._redact(message))
                return await (self.transport.send_frame(context, frame) if self.transport
                              else write(context, frame))
            case Offer(frame):
                return await write(context, frame)
            case RefusedCall(code, message, trailers):
                self._stats.refused(code, message)
                await context.abort(code, self._redact(message), trailing_metadata=trailers)
            case Finished():
                self._finished = True
            case Accepted():
                pass  # its metadata went out before
        return True

    async def _send_metadata(self, writes: bool) -> bool:
        """Send the stream's initial metadata if the coordinates are accepted and it has not
        gone yet (`writes`: a frame follows, which sends empty initial metadata if none went
        before it); False if the client has gone."""
        if self._metadata_sent:
            return True
        if self.metadata is None and not writes:
            return True  # the coordinates are not accepted yet
        self._metadata_sent = True
        try:
            await self._context.send_initial_metadata((*(self.metadata or ()),
                                                       *self._stats.capacity()))
        except Exception:  # the client went away: the call ends quietly, as a failed write
            return False
        return True
