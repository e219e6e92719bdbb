"""The bytes stoker.proto does not describe, said once for the server and the client.

stoker.proto is the gRPC half of the protocol; this module is its other half: how a
BatchFrame is laid out for a reader that slices its payload without a parse copy, and the
data connection beside the stream (docs/protocol.md#data-socket):

- frames: `data` (field 1) first, its tag DATA_TAG then its length as a varint;
- the claim: the offer's token (TOKEN_BYTES), then, when the offer asks for a proof,
  HMAC-SHA256(key = the bearer token, message = the token) (PROOF_BYTES);
- records, server to client: RECORD_LENGTH (a 4-byte little-endian length), a BatchFrame
  of that length, then its `payload_bytes` bytes when it is `via_socket`;
- credit records, client to server: CREDIT_COUNT (a 4-byte little-endian count n), then n
  little-endian int64 batch indices.

Imports the standard library and numpy only: the server core has no torch, the client core
no server dependencies, and both import this. The constants and structs are for the hot
paths (one record per batch), which use them inline rather than through a call.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np


class WireError(ValueError):
    """Bytes that do not follow this module's layouts; the message says where."""


# -- metadata --------------------------------------------------------------------------------

# gRPC metadata keys of the protocol (docs/protocol.md), declared here alone: the dataset
# fingerprint a server holds (the trailers of a FAILED_PRECONDITION refusal of other data,
# and a stream's initial metadata), and what a server can do (a stream's initial metadata:
# "WORKERS SAMPLES_PER_SECOND", as DescribeDatasetResponse.capacity).
FINGERPRINT_KEY = "stoker-fingerprint"
CAPACITY_KEY = "stoker-capacity"


def capacity_metadata(workers: int, rate: float) -> tuple[tuple[str, str], ...]:
    """A stream's initial metadata saying what its server can do (read by capacity_of)."""
    return ((CAPACITY_KEY, f"{workers} {rate:.6g}"),)


def capacity_of(metadata: Iterable[tuple[str, Any]] | None) -> tuple[int, float]:
    """(workers, samples/s) from a stream's `stoker-capacity` metadata (stoker.proto's
    DescribeDatasetResponse.capacity); (0, 0.0) from a server that does not say."""
    for key, value in metadata or ():
        if key == CAPACITY_KEY:
            try:
                workers, rate = str(value).split()
                return int(workers), float(rate)
            except ValueError:
                break
    return 0, 0.0


# -- frames ----------------------------------------------------------------------------------

# The name of BatchFrame's oneof: WhichOneof(FRAME_KIND) says which kind of frame it is
# ("data", "error", "shm_name", "data_socket", "via_socket"; None: a header whose `data`
# was sliced off before the parse, see read_data_prefix).
FRAME_KIND = "kind"
DATA_TAG = 0x0A  # BatchFrame.data: field 1, wire type 2 (length-delimited)
DATA_TAG_BYTE = bytes((DATA_TAG,))
_VARINT_MAX = 10  # bytes of the longest varint (a 64-bit value)


def data_prefix(n: int) -> bytes:
    """The bytes before `n` bytes of BatchFrame.data written first: its tag, its length."""
    out = bytearray(DATA_TAG_BYTE)
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def read_data_prefix(buf: bytes | memoryview) -> tuple[int, int] | None:
    """(start, length) of `data` in a serialized BatchFrame that writes it first; None if
    `buf` does not begin with its tag. WireError if the length does not fit in `buf`."""
    if not buf or buf[0] != DATA_TAG:
        return None
    n = shift = 0
    pos = 1
    while pos <= _VARINT_MAX:
        if pos >= len(buf):
            raise WireError("a frame ends inside its data length")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            if pos + n > len(buf):
                raise WireError(f"a frame's data claims {n} bytes, {len(buf) - pos} follow")
            return pos, n
        shift += 7
    raise WireError("a frame's data length is longer than 10 bytes")


# -- records on the data connection ----------------------------------------------------------

RECORD_LENGTH = struct.Struct("<I")  # the length of the BatchFrame that follows
MAX_RECORD_FRAME = 1 << 24  # a record's frame holds headers only: never near this


# -- the claim -------------------------------------------------------------------------------

TOKEN_BYTES = 16
PROOF_BYTES = 32  # HMAC-SHA256


def proof(bearer: bytes, token: bytes) -> bytes:
    """What a claim carries after `token` when the server checks the bearer token."""
    return hmac.new(bearer, token, hashlib.sha256).digest()


def claim_length(with_proof: bool) -> int:
    return TOKEN_BYTES + (PROOF_BYTES if with_proof else 0)


def encode_claim(token: bytes, bearer: bytes | None) -> bytes:
    """The claim a client sends first on its data connection; `bearer` None: no proof."""
    return token if bearer is None else token + proof(bearer, token)


def claim_token(claim: bytes, bearer: bytes | None) -> bytes | None:
    """The token `claim` names, if it is whole and (`bearer` given) carries that bearer
    token's proof; None otherwise. Compares the proof in constant time."""
    if len(claim) != claim_length(bearer is not None):
        return None
    token = claim[:TOKEN_BYTES]
    if bearer is not None and not hmac.compare_digest(claim[TOKEN_BYTES:],
                                                      proof(bearer, token)):
        return None
    return token


# -- credit records --------------------------------------------------------------------------

CREDIT_COUNT = struct.Struct("<I")
CREDIT_INDEX = np.dtype("<i8")


class CreditCountError(WireError):
    """A credit record whose count is not in [1, limit]; `count` is what it said."""

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"a credit record of {count} batch indices (1 to {limit})")
        self.count = count


def encode_credits(indices: Sequence[int]) -> bytes:
    """One credit record: the count, then each batch index."""
    return struct.pack(f"<I{len(indices)}q", len(indices), *indices)


def decode_credits(buf: bytes, limit: int) -> tuple[list[int], int] | None:
    """(batch indices, bytes used) of the credit record at the start of `buf`; None while
    `buf` holds less than a whole one. CreditCountError if its count is not in [1, limit]
    (known from its first bytes: refused before the rest arrives)."""
    if len(buf) < CREDIT_COUNT.size:
        return None
    n = CREDIT_COUNT.unpack_from(buf)[0]
    if not 0 < n <= limit:
        raise CreditCountError(n, limit)
    end = CREDIT_COUNT.size + n * CREDIT_INDEX.itemsize
    if len(buf) < end:
        return None
    return np.frombuffer(buf, CREDIT_INDEX, n, CREDIT_COUNT.size).tolist(), end
