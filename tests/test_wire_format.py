"""The bytes both sides share (stoker.v1.wire): frames with `data` first, credit records and
claims, as docs/protocol.md spells them."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

import numpy as np
import pytest

from stoker.client._errors import ConnectionCut, ProtocolError
from stoker.client._frames import Assembler, split_frame
from stoker.server.front.frames import encode_socket_frame
from stoker.server.pool.layout import BuiltBatch, TensorLayout
from stoker.v1 import wire

pytestmark = pytest.mark.timeout(60)

BATCH = BuiltBatch(shm_name="stoker_test_segment", payload_bytes=160, num_samples=4, tensors=(
    TensorLayout("x", "float32", (4, 8), 0, 128), TensorLayout("y", "int64", (4,), 128, 32)))


def allocate(n: int) -> tuple[None, np.ndarray]:
    return None, np.empty(n, np.uint8)

def old_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


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
