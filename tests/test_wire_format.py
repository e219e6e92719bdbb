"""The bytes both sides share (stoker.v1.wire), and BatchFrame's oneof: every kind of frame is
the same on the wire as before the oneof (the offer less its old `batch_index` -1 marker),
and what an older server sent still reads."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

import numpy as np
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from stoker.client._errors import ConnectionCut, ProtocolError
from stoker.client.transport.frames import Assembler, split_frame
from stoker.server.front.frame_encoding import (
    encode_error,
    encode_frame,
    encode_shm_frame,
    encode_socket_frame,
    encode_socket_offer,
)
from stoker.server.pool.layout import BuiltBatch, TensorLayout
from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import wire

pytestmark = pytest.mark.timeout(60)

BATCH = BuiltBatch(shm_name="stoker_test_segment", payload_bytes=160, num_samples=4, tensors=(
    TensorLayout("x", "float32", (4, 8), 0, 128), TensorLayout("y", "int64", (4,), 128, 32)))


def old_batch_frame() -> type:
    """BatchFrame as it was before the oneof: the same fields, numbers and order, no oneof."""
    file = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file)
    file.name = "old/stoker.proto"
    (frame,) = [m for m in file.message_type if m.name == "BatchFrame"]
    fields = sorted(frame.field, key=lambda f: f.number)
    for f in fields:
        f.ClearField("oneof_index")
    del frame.field[:]
    frame.field.extend(fields)
    del frame.oneof_decl[:]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("stoker.v1.BatchFrame"))


Old = old_batch_frame()


def allocate(n: int) -> tuple[None, np.ndarray]:
    return None, np.empty(n, np.uint8)


def old_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def old_tensors() -> list[dict]:
    return [dict(name=t.name, dtype=t.dtype, shape=t.shape, offset=t.offset, nbytes=t.nbytes)
            for t in BATCH.tensors]


def test_the_frame_schema_has_one_oneof_over_the_old_field_numbers() -> None:
    oneof = pb.BatchFrame.DESCRIPTOR.oneofs_by_name[wire.FRAME_KIND]
    assert {f.name: f.number for f in oneof.fields} == {
        "data": 1, "error": 7, "shm_name": 8, "data_socket": 10, "via_socket": 11}
    old = {f.name: f.number for f in Old.DESCRIPTOR.fields}
    assert {f.name: f.number for f in pb.BatchFrame.DESCRIPTOR.fields} == old


@pytest.mark.parametrize("offset, length", [(0, 160), (64, 96), (0, 0), (0, 300)])
def test_a_data_frame_is_byte_identical(offset: int, length: int) -> None:
    data = bytes(range(256))[:length]
    for compression in ("", "zstd"):
        new = encode_frame(BATCH, data, offset, 7, 2, compression)
        head = Old(batch_index=7, epoch=2, offset=offset, payload_bytes=160,
                   compression=compression, tensors=old_tensors() if offset == 0 else ())
        assert new == b"\x0a" + old_varint(len(data)) + data + head.SerializeToString()
        chunk, parsed = split_frame(new)
        assert bytes(chunk) == data and parsed.WhichOneof(wire.FRAME_KIND) is None
        full = pb.BatchFrame.FromString(new)
        assert full.WhichOneof(wire.FRAME_KIND) == "data" and full.data == data


def test_shm_socket_and_error_frames_are_byte_identical() -> None:
    shm = Old(batch_index=3, epoch=1, offset=0, payload_bytes=160, tensors=old_tensors(),
              shm_name=BATCH.shm_name)
    assert encode_shm_frame(BATCH, 3, 1) == shm.SerializeToString()
    record = (Old(batch_index=3, epoch=1).SerializeToString() + Old(
        payload_bytes=160, via_socket=True, tensors=old_tensors()).SerializeToString())
    assert encode_socket_frame(BATCH, 3, 1) == record
    error = Old(batch_index=5, epoch=1, error=dict(code=15, message="batch 5: bad sample"))
    assert encode_error(5, 1, 15, "batch 5: bad sample") == error.SerializeToString()
    for raw, kind in ((shm, "shm_name"), (error, "error")):
        assert pb.BatchFrame.FromString(raw.SerializeToString()).WhichOneof("kind") == kind
    assert pb.BatchFrame.FromString(record).WhichOneof(wire.FRAME_KIND) == "via_socket"


def test_the_offer_is_its_own_kind_and_an_old_servers_offer_still_reads() -> None:
    offer = dict(port=4242, token=b"t" * 16, proof=True, credits=True)
    new = encode_socket_offer(4242, b"t" * 16, proof=True, credits=True)
    assert new == Old(data_socket=offer).SerializeToString()  # no batch_index: no -1
    assert pb.BatchFrame.FromString(new).WhichOneof(wire.FRAME_KIND) == "data_socket"
    before = Old(batch_index=-1, data_socket=offer).SerializeToString()
    got = Assembler(lambda n: (None, None)).feed(before)
    assert isinstance(got, pb.DataSocket) and got.port == 4242 and got.token == b"t" * 16
    assert Old.FromString(new).HasField("data_socket")  # an old client reads the new offer


def test_a_data_prefix_reads_back_and_a_bad_one_is_a_protocol_error() -> None:
    for n in (0, 1, 127, 128, 300):
        prefix = wire.data_prefix(n)
        assert prefix == b"\x0a" + old_varint(n)
        assert wire.read_data_prefix(prefix + bytes(n) + b"rest") == (len(prefix), n)
    assert wire.data_prefix((1 << 35) + 5) == b"\x0a" + old_varint((1 << 35) + 5)
    assert wire.read_data_prefix(b"\x12\x00") is None
    for bad, match in ((b"\x0a", "inside its data length"), (b"\x0a\x05ab", "claims 5 bytes"),
                       (b"\x0a" + b"\xff" * 11, "longer than 10 bytes")):
        with pytest.raises(ProtocolError, match=match):
            split_frame(bad)


def test_credit_records_and_claims_are_what_the_protocol_says() -> None:
    record = wire.encode_credits([0, 1, -2])
    assert record == struct.pack("<Iqqq", 3, 0, 1, -2)
    assert wire.decode_credits(record + b"more", 64) == ([0, 1, -2], len(record))
    assert wire.decode_credits(record[:-1], 64) is None
    assert wire.decode_credits(record[:3], 64) is None
    for count in (0, 65):
        with pytest.raises(wire.CreditCountError) as caught:
            wire.decode_credits(struct.pack("<I", count), 64)
        assert caught.value.count == count
    token, bearer = b"k" * wire.TOKEN_BYTES, b"bearer-token"
    claim = wire.encode_claim(token, bearer)
    assert claim == token + hmac.new(bearer, token, hashlib.sha256).digest()
    assert wire.claim_token(claim, bearer) == token
    assert wire.claim_token(token, None) == token == wire.encode_claim(token, None)
    assert wire.claim_token(claim, b"another token") is None
    assert wire.claim_token(token, bearer) is None and wire.claim_token(claim[:-1], bearer) is None


def test_a_record_cut_short_is_a_connection_cut_not_a_bad_record() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        head = encode_socket_frame(BATCH, 0, 0)
        theirs.sendall(wire.RECORD_LENGTH.pack(len(head)) + head + b"\0" * 10)
        theirs.close()
        assembler = Assembler(allocate)
        with pytest.raises(ConnectionCut, match="closed after"):
            assembler.receive(ours)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(wire.RECORD_LENGTH.pack(wire.MAX_RECORD_FRAME + 1))
        with pytest.raises(ProtocolError) as caught:
            Assembler(allocate).receive(ours)
        assert not isinstance(caught.value, ConnectionCut)
