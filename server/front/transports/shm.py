"""Shared memory: a client on the same host maps the worker's segment itself.

The stream sends one header frame per batch, naming the segment; the segment is lent to the
client until it names it in `StreamRequest.released`. Same host is proven by the stream's
shm probe (a segment the client made, with a token only a reader of it knows; see _shm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from ..frame_encoding import encode_shm_frame
from .base import BatchOwner, Transport, write

if TYPE_CHECKING:
    from ...pool.layout import BuiltBatch


class ShmTransport(Transport):
    label = "shm"

    def __init__(self, pool: BatchOwner) -> None:
        self._pool = pool
        # By segment name, each time it was lent and not yet released: a stream that asks
        # for one batch twice is lent one (shared) segment twice, and holds two references.
        self._lent: dict[str, list[BuiltBatch]] = {}

    async def send(self, context: grpc.aio.ServicerContext, batch: BuiltBatch,
                   batch_index: int, epoch: int) -> bool:
        # Until the client releases it, or the stream ends.
        self._lent.setdefault(batch.shm_name, []).append(batch)
        return await write(context, encode_shm_frame(batch, batch_index, epoch))

    def returned(self, shm_name: str) -> None:
        lent = self._lent.get(shm_name)
        if lent:
            batch = lent.pop()
            if not lent:
                del self._lent[shm_name]
            self._pool.release(batch)

    def close(self) -> None:
        """Lent segments are unlinked, not reused: the client may be reading one still."""
        for lent in self._lent.values():
            for batch in lent:
                self._pool.release(batch, reuse=False)
        self._lent.clear()
