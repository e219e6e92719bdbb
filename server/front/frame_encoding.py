"""Encode a built batch as BatchFrame messages, pre-serialized.

`data` (field 1) is written first and by hand (its layout: stoker.v1.wire), so the payload
is copied once, from shared memory into the message; a protobuf round trip would copy it
three more times. The result is an ordinary BatchFrame to any protobuf parser. Each function
makes one kind of frame (BatchFrame's oneof `kind`).
"""

from __future__ import annotations

import functools

from stoker.v1 import stoker_pb2 as pb
from stoker.v1.wire import data_prefix

from ..pool.layout import BuiltBatch, TensorLayout


def tensor_infos(tensors: tuple[TensorLayout, ...]) -> list[pb.TensorInfo]:
    return [pb.TensorInfo(name=t.name, dtype=t.dtype, shape=t.shape, offset=t.offset,
                          nbytes=t.nbytes) for t in tensors]


def encode_frame(batch: BuiltBatch, data: memoryview | bytes, offset: int, batch_index: int,
                 epoch: int, compression: str = "") -> bytes:
    """One BatchFrame: `data` (the payload from `offset`, compressed as `compression` says)
    first, then the header fields."""
    head = pb.BatchFrame(batch_index=batch_index, epoch=epoch, offset=offset,
                         payload_bytes=batch.payload_bytes, compression=compression,
                         tensors=tensor_infos(batch.tensors) if offset == 0 else ())
    return b"".join((data_prefix(len(data)), data, head.SerializeToString()))


def encode_shm_frame(batch: BuiltBatch, batch_index: int, epoch: int) -> bytes:
    """The one frame of a batch the client reads from shared memory itself (same host)."""
    return pb.BatchFrame(batch_index=batch_index, epoch=epoch, offset=0,
                         payload_bytes=batch.payload_bytes, tensors=tensor_infos(batch.tensors),
                         shm_name=batch.shm_name).SerializeToString()


def encode_socket_frame(batch: BuiltBatch, batch_index: int, epoch: int) -> bytes:
    """The frame of a batch's record on the data connection (its payload follows it).

    Two serialized BatchFrames end to end, which a parser reads as one (protobuf merges
    them): the index and epoch, then the layout, the same for every batch of a stream (made
    once per layout: a tenth of the front end's time per batch at 64 KiB batches)."""
    return (pb.BatchFrame(batch_index=batch_index, epoch=epoch).SerializeToString()
            + _socket_layout(batch.tensors, batch.payload_bytes))


@functools.lru_cache(maxsize=256)
def _socket_layout(tensors: tuple[TensorLayout, ...], payload_bytes: int) -> bytes:
    return pb.BatchFrame(payload_bytes=payload_bytes, via_socket=True,
                         tensors=tensor_infos(tensors)).SerializeToString()


def encode_socket_offer(port: int, token: bytes, proof: bool = False,
                        credits: bool = False) -> bytes:
    """A stream's first frame when its client asked for a data connection; `proof`: its claim
    must carry the proof of the bearer token; `credits`: credits may come on the connection."""
    return pb.BatchFrame(data_socket=pb.DataSocket(
        port=port, token=token, proof=proof, credits=credits)).SerializeToString()


def encode_error(batch_index: int, epoch: int, code: int, message: str) -> bytes:
    """The one frame that answers a batch which could not be built."""
    return pb.BatchFrame(batch_index=batch_index, epoch=epoch,
                         error=pb.BatchError(code=code, message=message)).SerializeToString()
