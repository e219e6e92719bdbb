"""Decode BatchFrames and assemble batch payloads, copying each byte once.

Servers put `data` first on the wire (see server/_frames.py): the payload is sliced out of the
received message without a parse copy and copied straight into the batch's buffer. Any other
field order still decodes, through protobuf.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker.v1 import stoker_pb2 as pb

from ._samehost import read_segment

log = logging.getLogger("stoker.client")
CONNECT_TIMEOUT = 5.0  # seconds to reach a server's data socket

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
        self.host = ""  # the server's host, for its data socket
        self.sock: socket.socket | None = None  # the data socket, once connected
        self._current: tuple[pb.BatchFrame, Any, np.ndarray, int] | None = None

    def _connect(self, offer: pb.DataSocket) -> None:
        """Connect to the server's data socket and present the token. If that fails, the
        server sends the payloads in frames after a few seconds: nothing else to do."""
        sock = None
        try:
            sock = socket.create_connection((self.host, offer.port), timeout=CONNECT_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(offer.token)
            sock.settimeout(None)  # a stalled server is the scheduler's to judge (close())
        except OSError as e:
            if sock is not None:
                sock.close()
            log.warning("cannot connect to the data socket %s:%d (%s); batches come in "
                        "frames", self.host, offer.port, e)
            return
        self.sock = sock

    def close(self) -> None:
        """Unblock a receive waiting on the data socket, and close it (any thread)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()

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
        if head.HasField("data_socket"):  # the stream's offer, before any batch
            self._connect(head.data_socket)
            return None
        if head.via_socket:  # the payload follows on the data socket, in order
            if self.sock is None:
                raise ValueError(f"batch {head.batch_index} was sent on a data socket that "
                                 "this client has not connected")
            owner, view = self._allocate(head.payload_bytes)
            _recv_exactly(self.sock, memoryview(view[: head.payload_bytes]).cast("B"))
            return Assembled(head.batch_index, head.epoch, owner, list(head.tensors),
                             head.payload_bytes, shared=True)
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


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ValueError(f"the data socket closed after {got} of {len(view)} bytes")
        got += n


def numpy_views(payload: np.ndarray, tensors: list[pb.TensorInfo]) -> dict[str, np.ndarray]:
    """Each tensor as a numpy view into the payload (no copy)."""
    out = {}
    for t in tensors:
        dtype = np.dtype(t.dtype).newbyteorder("<")
        arr = payload[t.offset : t.offset + t.nbytes].view(dtype).reshape(tuple(t.shape))
        out[t.name] = arr
    return out
