"""A stream's credits: how many are outstanding, and what each becomes. A credit is checked
against max_credits, its batch's samples are computed (in a thread for an epoch not seen yet),
and its batch is built, or answered UNAVAILABLE in-band when the server drains or the client
holds too much shared memory. What comes of each goes on the stream's ready queue.

Threading contract: a Credits belongs to one stream and runs on the server's one asyncio loop;
`take` is called by the stream's readers one message at a time (their lock), `answered` by its
sender.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Hashable
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc

from ..order.epochs import epoch_size, samples_of
from ..order.sampling import CoordinateError, Coordinates
from ..pool.workers import BatchFailed, FailureKind
from .ready import FailedBatch, ReadyBatch
from .refusal import Abort

if TYPE_CHECKING:
    import numpy as np

    from ..pool.workers import DatasetMeta
    from .ready import Ready
    from .session_context import SessionContext

# A batch whose samples are all excluded (server/order/sampling.py's Exclusion) is not built: it is
# answered with this in-band status, and the client makes the batch of 0 rows itself.
EMPTIED = grpc.StatusCode.OUT_OF_RANGE
EMPTIED_WHY = "every sample of this batch is excluded (0 rows)"

# BatchFailed.kind -> the status its batch is answered with.
FAILURE_CODE = {FailureKind.DATA_LOSS: grpc.StatusCode.DATA_LOSS,
                FailureKind.INTERNAL: grpc.StatusCode.INTERNAL,
                FailureKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
                FailureKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE}
# Each stream's name for the shared builds (whether another stream asked for the same
# coordinates). Not id(): ids are reused once freed.
_STREAMS = itertools.count()


class Credits:
    """The credits of one stream of `client`, whose batches count against it in the
    admission from the moment they are built until they go back to the pool. `outstanding`:
    credits not answered yet (counted up by `take`, down by `answered`); `jobs`: builds
    under way (the stream cancels them when it closes)."""

    def __init__(self, front: SessionContext, client: str, ready: asyncio.Queue[Ready],
                 peer: str = "") -> None:
        self._front = front
        self._client = client
        self._ready = ready
        self._stream = next(_STREAMS)
        self._peer = peer  # the client's connection (address and port)
        self._lane: tuple[Coordinates, Hashable] | None = None  # (coordinates, their lane)
        self.outstanding = 0
        self.jobs: set[asyncio.Task] = set()
        self._last_payload = 0  # bytes of this stream's last batch: the next one's estimate
        # Coordinates whose epoch order a thread has made (cached in sampling.ORDERS): later
        # credits under them are sliced on the loop (see take).
        self._warm: Coordinates | None = None

    def answered(self, n: int) -> None:
        """`n` credits answered: their batches (or errors) start out."""
        self.outstanding -= n

    async def take(self, coords: Coordinates, meta: DatasetMeta,
                   batch_indices: list[int]) -> None:
        """Start building each credited batch (or, draining or over a held-memory limit,
        answer it UNAVAILABLE)."""
        n = self.outstanding + len(batch_indices)
        limit = self._front.settings.max_credits
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
            if not len(indices):  # every sample excluded: the client makes its empty batch
                self._ready.put_nowait(FailedBatch(index, coords.epoch, EMPTIED,
                                                   f"batch {index}: {EMPTIED_WHY}"))
                continue
            if self._front.draining():  # finish what was asked before, take nothing new
                self._unavailable(index, coords.epoch, "server draining, ask another")
                continue
            # No room for a batch like the last one: not built at all (_build checks the
            # batch itself, exactly, once built).
            if (why := self._front.admission.over(self._client, self._last_payload)):
                self._unavailable(index, coords.epoch, why)
                continue
            job = asyncio.create_task(self._build(coords, index, indices, ahead))
            self.jobs.add(job)
            job.add_done_callback(self.jobs.discard)

    def _samples(self, meta: DatasetMeta, coords: Coordinates, index: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Batch `index`'s samples, and those of the batch `lookahead` further on, which the
        workers fetch from storage ahead of time."""
        indices = samples_of(meta, coords, index)
        later = index + self._front.lookahead()
        if meta.prefetches and later < epoch_size(meta, coords)[0]:
            return indices, samples_of(meta, coords, later)
        return indices, indices[:0]

    async def _build(self, coords: Coordinates, index: int, indices: np.ndarray,
                     ahead: np.ndarray) -> None:
        # Shared with every stream that asks for the same batch (server/front/shared_batches.py);
        # this stream holds its reference from here on, released like any batch.
        pool = self._front.shared
        try:
            batch, _ = await pool.get(coords, index, indices, ahead, stream=self._stream,
                                      lane=self._lane_of(coords))
        except BatchFailed as e:
            self._ready.put_nowait(FailedBatch(index, coords.epoch, FAILURE_CODE[e.kind],
                                               f"batch {index}: {e}", e.detail))
            return
        admission = self._front.admission
        if (why := admission.over(self._client, batch.payload_bytes)):
            pool.release(batch)  # never held: back to its worker at once
            self._unavailable(index, coords.epoch, why)
            return
        admission.hold(self._client, batch.payload_bytes)
        self._last_payload = batch.payload_bytes
        self._ready.put_nowait(ReadyBatch(batch, index, coords.epoch))

    def _lane_of(self, coords: Coordinates) -> Hashable:
        """The workers' fair queue's lane for a batch of `coords` (server/pool/fair_queue.py):
        this connection's reading of these coordinates, whatever the epoch (and the start a
        resumed epoch has). A loader asks for the next epoch on a stream of its own while
        its current one ends, and wants its batches in that order: as two lanes, the next
        epoch's first credits (a burst of a window's worth) were served in turn with the
        current epoch's last batches, which the loop waits for first: one rank against 16
        workers, 48-batch epochs, 12 of the 60 batches built while it read an epoch were the
        next epoch's, and it read 0.59 of capacity (0.81 as one lane; issue 49). Ranks,
        datasets and connections stay lanes of their own; loaders of one process share a
        connection, and of those only readers of the same batches (a sweep's jobs, which
        share their builds) share a lane."""
        if self._lane is None or self._lane[0] != coords:
            self._lane = (coords, (self._peer, replace(coords, epoch=0, start=0)))
        return self._lane[1]

    def _unavailable(self, index: int, epoch: int, why: str) -> None:
        """Batch `index` answered UNAVAILABLE in-band: the client asks another server."""
        self._ready.put_nowait(FailedBatch(index, epoch, grpc.StatusCode.UNAVAILABLE,
                                           f"batch {index}: {why}"))
