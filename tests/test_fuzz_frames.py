"""Bad frames and bad data-socket connections.

The client's frame reassembly (client/transport/frames.py) gets hypothesis-generated frame
sequences: valid ones must reassemble byte-exactly; reordered, truncated, corrupted ones,
wrong sizes, overlapping offsets, bad dtypes and huge shapes must raise its ProtocolError,
never anything else, and never ask for more memory than the header can justify. The server's data
socket gets raw TCP connections with garbage, short and wrong tokens, and keeps serving.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import grpc
import numpy as np
import pytest
import zstandard
from epochs import epoch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.client._errors import ProtocolError
from stoker.client.transport.frames import READ_AHEAD, Assembled, Assembler
from stoker.client.transport.tensors import MAX_PAYLOAD_BYTES, numpy_views
from stoker.v1 import stoker_pb2 as pb
from stoker.v1.wire import data_prefix

pytestmark = pytest.mark.timeout(180)

FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = ["uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]
BAD_DTYPES = ["object", "O", "V8", "i4,i4", "<U3", "S5", "datetime64[s]", "", "🦄", "int99",
              "(2,)i4", "[('a', 'i4')]", "float32\x00", "M8", "x" * 5000]
LIMIT = 1 << 20  # the largest batch generated here; a header asking for more is corrupt





@st.composite
def batch(draw: st.DrawFn, index: int) -> tuple[dict[str, np.ndarray], list[bytes]]:
    """A batch's tensors and its frames, as the protocol describes them."""
    rows = draw(st.integers(0, 4))
    arrays: dict[str, np.ndarray] = {}
    for k in range(draw(st.integers(1, 4))):
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        shape = (rows, *draw(st.lists(st.integers(0, 5), max_size=2)))
        raw = draw(st.binary(min_size=int(np.prod(shape)) * dtype.itemsize,
                             max_size=int(np.prod(shape)) * dtype.itemsize))
        if dtype == np.bool_:
            raw = bytes(b & 1 for b in raw)
        arrays[f"f{k}"] = np.frombuffer(raw, dtype).reshape(shape)
    tensors, payload = [], bytearray()
    for name, a in arrays.items():
        payload += bytes(-len(payload) % 64)
        tensors.append(pb.TensorInfo(name=name, dtype=a.dtype.name, shape=a.shape,
                                     offset=len(payload), nbytes=a.nbytes))
        payload += a.tobytes()
    step = draw(st.sampled_from([7, 64, 100, 1 << 20]))
    zstd = draw(st.booleans())
    frames = []
    for offset in range(0, max(len(payload), 1), step):
        data = bytes(payload[offset : offset + step])
        head = pb.BatchFrame(batch_index=index, epoch=1, offset=offset,
                             payload_bytes=len(payload),
                             tensors=tensors if offset == 0 else ())
        if zstd and data:
            head.compression, data = "zstd", zstandard.ZstdCompressor().compress(data)
        if draw(st.booleans()):  # data first and by hand, as the server writes it
            frames.append(data_prefix(len(data)) + data + head.SerializeToString())
        else:  # data last: the parser's fallback path
            frames.append(head.SerializeToString() + pb.BatchFrame(data=data).SerializeToString())
    return arrays, frames


def _edit(raw: bytes, change: Any) -> bytes:
    frame = pb.BatchFrame.FromString(raw)
    change(frame)
    return frame.SerializeToString()


def _tensor(frame: pb.BatchFrame, **kw: Any) -> None:
    if frame.tensors:
        t = frame.tensors[len(frame.tensors) - 1]
        for k, v in kw.items():
            if k == "shape":
                del t.shape[:]
                t.shape.extend(v)
            else:
                setattr(t, k, v)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, list[dict[str, np.ndarray]], list[bytes]]:
    """(what was done, the batches, their frames after it)."""
    batches = [draw(batch(i)) for i in range(draw(st.integers(1, 2)))]
    frames = [f for _, fs in batches for f in fs]
    arrays = [a for a, _ in batches]
    kind = draw(st.sampled_from([
        "none", "none", "swap", "drop", "duplicate", "truncate", "flip", "garbage",
        "payload_bytes", "offset", "dtype", "shape", "huge_shape", "consistent_huge", "nbytes",
        "tensor_offset", "compression", "zstd_bomb", "extra_data"]))
    i = draw(st.integers(0, len(frames) - 1))
    big = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([-1, 2**62, LIMIT + 1]))
    if kind == "swap" and len(frames) > 1:
        j = draw(st.integers(0, len(frames) - 1).filter(lambda j: frames[j] != frames[i]))
        frames[i], frames[j] = frames[j], frames[i]
    elif kind == "drop":
        del frames[i]
    elif kind == "duplicate":
        frames.insert(i, frames[i])
    elif kind == "truncate":
        frames[i] = frames[i][: draw(st.integers(0, max(len(frames[i]) - 1, 0)))]
    elif kind == "flip" and frames[i]:
        k = draw(st.integers(0, len(frames[i]) - 1))
        frames[i] = frames[i][:k] + bytes([frames[i][k] ^ draw(st.integers(1, 255))]) \
            + frames[i][k + 1 :]
    elif kind == "garbage":
        frames[i] = draw(st.binary(max_size=300))
    elif kind == "payload_bytes":
        v = draw(big)
        frames[i] = _edit(frames[i], lambda f: setattr(f, "payload_bytes", v))
    elif kind == "offset":
        v = draw(st.one_of(big, st.integers(-70, 300)))
        frames[i] = _edit(frames[i], lambda f: setattr(f, "offset", v))
    elif kind == "dtype":
        v = draw(st.one_of(st.sampled_from(BAD_DTYPES), st.text(max_size=12)))
        frames[0] = _edit(frames[0], lambda f: _tensor(f, dtype=v))
    elif kind == "shape":
        v = draw(st.lists(st.one_of(st.integers(-3, 8), big), max_size=70))
        frames[0] = _edit(frames[0], lambda f: _tensor(f, shape=v))
    elif kind == "huge_shape":
        v = draw(st.lists(st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1]), min_size=1,
                          max_size=3))
        frames[0] = _edit(frames[0], lambda f: _tensor(f, shape=v))
    elif kind == "consistent_huge":  # a header that adds up, to more than any batch is
        n = 1 << draw(st.integers(37, 62))

        def huge(f: pb.BatchFrame) -> None:
            del f.tensors[:]
            f.tensors.add(name="x", dtype="uint8", shape=[n], offset=0, nbytes=n)
            f.payload_bytes = n
        frames[0] = _edit(frames[0], huge)
    elif kind == "nbytes":
        v = draw(big)
        frames[0] = _edit(frames[0], lambda f: _tensor(f, nbytes=v))
    elif kind == "tensor_offset":  # overlapping, misaligned, negative, past the end
        v = draw(st.one_of(big, st.integers(-128, 256)))
        frames[0] = _edit(frames[0], lambda f: _tensor(f, offset=v))
    elif kind == "compression":
        v = draw(st.one_of(st.just("gzip"), st.text(min_size=1, max_size=8)))
        frames[i] = _edit(frames[i], lambda f: setattr(f, "compression", v))
    elif kind == "zstd_bomb":  # a zstd frame of zeros far larger than the batch
        bomb = zstandard.ZstdCompressor().compress(bytes(draw(st.sampled_from([1 << 16,
                                                                                 4 << 20]))))
        frames[i] = _edit(frames[i], lambda f: (setattr(f, "data", bomb),
                                                setattr(f, "compression", "zstd")))
    elif kind == "extra_data":
        frames[i] = _edit(frames[i], lambda f: setattr(f, "data", f.data + b"\x01" * 65))
    return kind, arrays, frames


def allocate(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    assert 0 <= nbytes <= LIMIT, f"asked to allocate {nbytes} bytes"
    buf = np.empty(nbytes, np.uint8)
    return buf, buf


def assemble(frames: list[bytes]) -> list[dict[str, np.ndarray]]:
    assembler = Assembler(allocate)
    out = []
    for raw in frames:
        done = assembler.feed(raw)
        assert not isinstance(done, pb.BatchFrame)  # no error frames generated
        if isinstance(done, Assembled):
            assert done.payload_bytes <= LIMIT
            out.append(numpy_views(done.buffer[: done.payload_bytes], done.tensors))
    return out


def test_frame_sequences(ledger) -> None:
    outcomes: dict[str, int] = {}

    @settings(FUZZ, max_examples=600)
    @given(mutated())
    def inner(case: tuple[str, list[dict[str, np.ndarray]], list[bytes]]) -> None:
        kind, arrays, frames = case
        try:
            got = assemble(frames)
        except ProtocolError as e:
            assert kind != "none", e
            assert "Traceback" not in str(e) and len(str(e)) < 1000
            outcome = "ProtocolError"
        else:
            outcome = "assembled"
            if kind == "none":
                assert len(got) == len(arrays)
                for want, have in zip(arrays, got, strict=True):
                    assert list(want) == list(have)
                    for k, a in want.items():
                        assert have[k].dtype == a.dtype and have[k].shape == a.shape
                        assert have[k].tobytes() == a.tobytes()
        outcomes[f"{kind}: {outcome}"] = outcomes.get(f"{kind}: {outcome}", 0) + 1

    inner()
    tried = sum(outcomes.values())
    caught = sum(v for k, v in outcomes.items() if k.endswith("ProtocolError"))
    ledger.record("bad requests", "client frame reassembly: generated frame sequences, "
                  "reordered, truncated, corrupted, wrong sizes, bad dtypes, huge shapes, "
                  "zstd bombs", tried=tried,
                  detail=f"{caught} refused with ProtocolError, the rest assembled or "
                         "harmless (a dropped last frame leaves a batch pending)")
    assert caught > tried // 3
    assert MAX_PAYLOAD_BYTES < 1 << 40


def test_a_header_claiming_a_petabyte_is_refused_before_allocating() -> None:
    head = pb.BatchFrame(batch_index=0, offset=0, payload_bytes=1 << 50,
                         tensors=[pb.TensorInfo(name="x", dtype="uint8", shape=[1 << 50],
                                                nbytes=1 << 50)])
    with pytest.raises(ProtocolError, match=r"payload_bytes \d+ is not in"):
        Assembler(allocate).feed(head.SerializeToString())


def test_a_record_whose_frame_outgrows_the_read_ahead_buffer_is_read() -> None:
    # Thousands of tensors make a frame larger than the read-ahead buffer, which then grows
    # (growing it in place raised BufferError: every such batch broke the connection).
    def record(index: int, n: int) -> tuple[bytes, bytes]:
        payload = (np.arange(64 * n) % 251).astype(np.uint8).tobytes()
        frame = pb.BatchFrame(batch_index=index, epoch=0, offset=0, payload_bytes=64 * n,
                              via_socket=True, tensors=[
                                  pb.TensorInfo(name=f"t{i:05d}", dtype="uint8", shape=[64],
                                                offset=64 * i, nbytes=64) for i in range(n)]
                              ).SerializeToString()
        return struct.pack("<I", len(frame)) + frame + payload, payload

    (big, big_payload), (small, small_payload) = record(0, 4000), record(1, 1)
    assert len(big) - len(big_payload) > READ_AHEAD
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=a.sendall, args=(big + small,), daemon=True)
        sender.start()
        assembler = Assembler(allocate)
        got = [assembler.receive(b), assembler.receive(b)]
        sender.join(10)
    for done, index, payload in zip(got, (0, 1), (big_payload, small_payload), strict=True):
        assert isinstance(done, Assembled) and done.batch_index == index
        assert bytes(done.buffer[: done.payload_bytes]) == payload
    assert len(got[0].tensors) == 4000


# -- the data socket ----------------------------------------------------------------------
NOISE = {"noise": {"format": "python", "factory": "toy_datasets:Noise",
                   "options": {"n": 12, "shape": [16, 16]}}}


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module(NOISE, workers=1)


READ = {"batch_size": 3, "shared_memory": False}  # every epoch() here


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closes the connection having sent nothing."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def test_data_socket_garbage_short_and_wrong_tokens(server, ledger) -> None:
    port = server.ready["data_port"]
    expected = epoch(server, "noise", data_socket=True, **READ).indices()
    cases = [b"", b"\x00", b"short", bytes(15), bytes(16), b"\xff" * 16, b"x" * 4096,
             b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 64]
    # One connection that never sends its token stays open meanwhile: others are served.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as idle:
        for token in cases:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(token)
                if len(token) < 16:
                    sock.shutdown(socket.SHUT_WR)  # a short token, then nothing
                assert closed_by_server(sock), token[:20]
        got = epoch(server, "noise", data_socket=True, **READ).indices()
        idle.sendall(b"late")
    assert np.array_equal(got, expected)
    with grpc.insecure_channel(server.address) as channel:  # and plain frames, too
        grpc.channel_ready_future(channel).result(timeout=30)
    assert np.array_equal(epoch(server, "noise", **READ).indices(), expected)
    ledger.record("bad requests", "data socket: raw TCP with empty, short, wrong, oversized "
                  "and HTTP tokens, one idle connection", tried=len(cases) + 1,
                  detail="each closed by the server with nothing sent; epochs equal before "
                         "and after")
