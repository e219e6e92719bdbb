"""The payload in gRPC frames: the transport every client can use.

Each frame carries `frame_bytes` of the payload (the last one what is left); a client that
asked for compression="zstd" gets frames of at least MIN_COMPRESS bytes compressed, each
saying so in its `compression` field.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import grpc

from ..frame_encoding import encode_frame
from .base import BatchOwner, Transport, write

if TYPE_CHECKING:
    from ...pool.layout import BuiltBatch
    from ...pool.shm import ReadMappings

# Frames smaller than this go plain: compressing them saves nothing worth a thread hop.
MIN_COMPRESS = 64 << 10


def zstd_compressor() -> Any:
    """A zstd compressor for a stream that asked for one; None where zstandard is missing
    (frames then go plain, and say so)."""
    try:
        import zstandard
    except ImportError:
        return None
    # Level 1: about as fast as a 10 Gb/s link; higher levels cost CPU the workers need.
    return zstandard.ZstdCompressor(level=1)


class FramesTransport(Transport):
    def __init__(self, pool: BatchOwner, mappings: ReadMappings, frame_bytes: int,
                 zstd: Any = None) -> None:
        self._pool = pool
        self._mappings = mappings
        self._step = frame_bytes
        self._zstd = zstd

    async def send(self, context: grpc.aio.ServicerContext, batch: BuiltBatch,
                   batch_index: int, epoch: int) -> bool:
        """Send `batch` as frames over the stream; False if the client went away. The batch
        goes back to the pool in any case.

        Each frame's bytes are copied (or compressed from a copy) out of the segment before
        anything is awaited, so no view of the segment outlives a step: the segment can be
        handed back to its worker, and its mapping closed, whatever happens to the stream."""
        try:
            segment = self._mappings.get(batch.shm_name, batch.payload_bytes)
            total, step, zstd = batch.payload_bytes, self._step, self._zstd
            for offset in range(0, max(total, 1), step):
                with memoryview(segment) as view:
                    chunk = view[offset : min(offset + step, total)]
                    if zstd is not None and len(chunk) >= MIN_COMPRESS:
                        data, kind = bytes(chunk), "zstd"
                    else:
                        frame = encode_frame(batch, chunk, offset, batch_index, epoch)
                        data, kind = None, ""
                    chunk.release()
                if data is not None:
                    # In a thread: zstd releases the GIL; the loop serves other streams.
                    frame = encode_frame(batch, await asyncio.to_thread(zstd.compress, data),
                                         offset, batch_index, epoch, kind)
                if not await write(context, frame):
                    return False
            return True
        finally:
            self._pool.release(batch)
