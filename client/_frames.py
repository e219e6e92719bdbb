"""Decode BatchFrames and assemble batch payloads, copying each byte once.

Servers put `data` first on the wire (see server/_frames.py): the payload is sliced out of the
received message without a parse copy and copied straight into the batch's buffer. Any other
field order still decodes, through protobuf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker.v1 import stoker_pb2 as pb

from ._samehost import read_segment

_DATA_TAG = 0x0A


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def split_frame(raw: bytes) -> tuple[memoryview, pb.BatchFrame]:
    """(payload chunk, header fields) of one serialized BatchFrame."""
    if raw and raw[0] == _DATA_TAG:
        n, pos = _varint(raw, 1)
        view = memoryview(raw)
        return view[pos : pos + n], pb.BatchFrame.FromString(view[pos + n :].tobytes())
    frame = pb.BatchFrame.FromString(raw)
    return memoryview(frame.data), frame


@dataclass
class Assembled:
    """A whole batch payload: `buffer` holds it, `tensors` says where each tensor lies."""

    batch_index: int
    epoch: int
    buffer: Any  # what `allocate` returned
    tensors: list[pb.TensorInfo]
    payload_bytes: int
    shared: bool = False  # read from the server's shared memory, not from the frames


class Assembler:
    """Collects the frames of one stream into whole batches.

    `allocate(nbytes)` returns (owner, writable uint8 numpy view of at least nbytes); the owner
    is handed back in Assembled.buffer. Frames of one batch arrive in order and are not
    interleaved with another batch's (a server sends one batch at a time per stream).
    Threading: one thread feeds one Assembler.
    """

    def __init__(self, allocate: Callable[[int], tuple[Any, np.ndarray]],
                 release: Callable[[str], None] = lambda name: None) -> None:
        self._allocate = allocate
        self._release = release  # a same-host segment, once copied out
        self._zstd: Any = None
        self._current: tuple[pb.BatchFrame, Any, np.ndarray, int] | None = None

    def _decompress(self, kind: str, data: memoryview) -> bytes:
        if kind != "zstd":
            raise ValueError(f"frame compressed as {kind!r}, which this client cannot read")
        if self._zstd is None:
            import zstandard  # only streams that asked for compression get here

            self._zstd = zstandard.ZstdDecompressor()
        return self._zstd.decompress(data)

    def feed(self, raw: bytes) -> Assembled | pb.BatchFrame | None:
        """Take one frame; return the batch it completes, if any, or the frame itself when it
        answers its batch with an error."""
        data, head = split_frame(raw)
        if head.HasField("error"):
            return head
        if head.shm_name:  # same host: the whole payload is in the server's segment
            owner, view = self._allocate(head.payload_bytes)
            try:
                read_segment(head.shm_name, view[: head.payload_bytes])
            finally:
                self._release(head.shm_name)
            return Assembled(head.batch_index, head.epoch, owner, list(head.tensors),
                             head.payload_bytes, shared=True)
        if head.compression:
            data = memoryview(self._decompress(head.compression, data))
        if head.offset == 0:
            owner, view = self._allocate(head.payload_bytes)
            self._current = (head, owner, view, 0)
        if self._current is None or self._current[0].batch_index != head.batch_index:
            raise ValueError(f"frame of batch {head.batch_index} at offset {head.offset} arrived "
                             "without its first frame")
        first, owner, view, filled = self._current
        if head.offset != filled or filled + len(data) > first.payload_bytes:
            raise ValueError(f"batch {head.batch_index}: frame at offset {head.offset} of "
                             f"{len(data)} bytes does not follow byte {filled} of "
                             f"{first.payload_bytes}")
        view[filled : filled + len(data)] = np.frombuffer(data, np.uint8)
        filled += len(data)
        if filled < first.payload_bytes:
            self._current = (first, owner, view, filled)
            return None
        self._current = None
        return Assembled(first.batch_index, first.epoch, owner, list(first.tensors),
                         first.payload_bytes)


def numpy_views(payload: np.ndarray, tensors: list[pb.TensorInfo]) -> dict[str, np.ndarray]:
    """Each tensor as a numpy view into the payload (no copy)."""
    out = {}
    for t in tensors:
        dtype = np.dtype(t.dtype).newbyteorder("<")
        arr = payload[t.offset : t.offset + t.nbytes].view(dtype).reshape(tuple(t.shape))
        out[t.name] = arr
    return out
