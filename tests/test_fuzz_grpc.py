"""Property-based fuzzing of every gRPC request field, against a real server process.

Property: every call either succeeds with a well-formed answer or fails with a status code
that a client can act on (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, OUT_OF_RANGE) and a
message naming the bad field; never UNKNOWN/INTERNAL, never a traceback, never a hang (every
call has a deadline). Afterwards the server still serves a normal client exactly.

Each test runs an inner @given function and records in the ledger how many examples ran.
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stoker.server
from stoker.client import RemoteLoader
from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import stoker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(240)

N = 103
DATASETS = {"toy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": N}},
            "flaky": {"format": "python", "factory": "toy_datasets:toy",
                      "options": {"n": 40, "fail_at": [13]}}}
MAX_CREDITS = 8
SERVICE = "/stoker.v1.DataService/"
DEADLINE = 20.0  # seconds per call: far above what any call here needs; a hang fails

# Reproducible in CI: derandomized, no example database written to the work tree.
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

# What a bad field may end a call with; the message must start with the field it names.
ACCEPTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
FIELDS = ("request:", "coordinates:", "batch_size:", "world_size:", "rank:", "seed:", "epoch:",
          "start:", "batch_index:", "batch_indices:", "compression:", "report:", "dataset ")
# In-band, per batch: a corrupt sample (the flaky dataset's sample 13).
IN_BAND = {grpc.StatusCode.DATA_LOSS.value[0]}

INT64 = st.one_of(st.integers(-(2**63), 2**63 - 1),
                  st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, -(2**63), N, N - 1]),
                  st.integers(-3, 120))
SMALL = st.one_of(st.integers(-2, 12), INT64)
DATASET = st.one_of(st.sampled_from(["toy", "flaky", "", "Toy", "toy ", "toy\x00", "🦄" * 5]),
                    st.text(max_size=40), st.text(min_size=5000, max_size=20000))


def mostly(good: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
    """`good` seven times in eight: calls then often get past the first check."""
    return st.integers(0, 7).flatmap(lambda k: anything if k == 0 else good)


@st.composite
def coordinates(draw: st.DrawFn) -> pb.Coordinates:
    return pb.Coordinates(
        dataset=draw(mostly(st.sampled_from(["toy", "flaky"]), DATASET)),
        seed=draw(mostly(st.integers(0, 3), INT64)),
        epoch=draw(mostly(st.integers(0, 3), INT64)),
        shuffle=draw(st.booleans()),
        rank=draw(mostly(st.just(0), SMALL)),
        world_size=draw(mostly(st.just(1), SMALL)),
        batch_size=draw(mostly(st.integers(1, 12), INT64)),
        drop_last=draw(st.booleans()),
        start=draw(mostly(st.just(0), SMALL)))


FLOATS = st.one_of(st.floats(), st.floats(0, 100), st.sampled_from([0.0, -1.0, math.inf,
                                                                    math.nan, 1e308]))
PROBE_NAME = st.one_of(st.text(max_size=60), st.sampled_from([
    "stoker_client_1_" + "0" * 32, "stoker_client_999999999_" + "f" * 32, "../../etc/passwd",
    "/dev/shm/x", "stoker_1_2_3"]))


@st.composite
def stream_request(draw: st.DrawFn, first: bool) -> pb.StreamRequest:
    req = pb.StreamRequest()
    if draw(st.booleans()) if not first else draw(st.integers(0, 9)) > 0:
        req.coordinates.CopyFrom(draw(coordinates()))
    req.batch_indices.extend(draw(mostly(st.lists(st.integers(0, 9), max_size=6),
                                         st.lists(st.one_of(st.integers(0, 12), INT64),
                                                  max_size=12))))
    if draw(st.integers(0, 4)) == 0:
        req.shm_probe.name = draw(PROBE_NAME)
        req.shm_probe.token = draw(st.binary(max_size=40))
    req.released.extend(draw(st.lists(st.text(max_size=40), max_size=3)))
    if draw(st.integers(0, 3)) == 0:
        req.report.wait_seconds = draw(FLOATS)
        req.report.loop_seconds = draw(FLOATS)
    if draw(st.integers(0, 4)) == 0:
        req.compression = draw(st.one_of(st.just("zstd"), st.text(max_size=20)))
    req.data_socket = draw(st.integers(0, 5)) == 0
    return req


@st.composite
def stream_requests(draw: st.DrawFn) -> list[pb.StreamRequest]:
    n = draw(st.integers(1, 3))
    return [draw(stream_request(first=i == 0)) for i in range(n)]


def check_status(err: grpc.RpcError) -> str:
    code, details = err.code(), err.details() or ""
    assert code in ACCEPTED, f"{code}: {details}"
    assert details.startswith(FIELDS), details
    assert "Traceback" not in details and len(details) < 2000, details
    return code.name


def run_stream(channel: grpc.Channel, requests: list[pb.StreamRequest]) -> list[pb.BatchFrame]:
    """One StreamBatches call as a client would make it (the data socket included, when the
    server offers one); every frame checked as it comes."""
    call = channel.stream_stream(SERVICE + "StreamBatches",
                                 request_serializer=pb.StreamRequest.SerializeToString,
                                 response_deserializer=pb.BatchFrame.FromString)
    frames: list[pb.BatchFrame] = []
    sock, reader = None, None
    records: list[pb.BatchFrame] = []
    try:
        for frame in call(iter(requests), timeout=DEADLINE):
            frames.append(frame)
            if frame.HasField("data_socket"):
                assert (frame.WhichOneof("kind") == "data_socket"
                        and len(frame.data_socket.token) == 16)
                assert sock is None, "a second data socket offer"
                sock = socket.create_connection(("127.0.0.1", frame.data_socket.port), timeout=10)
                sock.sendall(frame.data_socket.token)
                reader = threading.Thread(target=read_records, args=(sock, records))
                reader.start()
            elif frame.HasField("error"):
                assert frame.error.code in IN_BAND, frame.error
                assert frame.error.message.startswith(f"batch {frame.batch_index}:")
            else:
                assert not frame.via_socket, "a data connection's record in a gRPC frame"
                assert 0 <= frame.offset <= frame.payload_bytes
    finally:
        if reader is not None:
            assert sock is not None
            reader.join(DEADLINE)  # the server closes the connection as the call ends
            sock.close()
    for record in records:
        if record.HasField("error"):
            assert record.error.code in IN_BAND, record.error
            assert record.error.message.startswith(f"batch {record.batch_index}:")
    return frames + records


def read_records(sock: socket.socket, into: list[pb.BatchFrame]) -> None:
    """The data connection's records (length, frame, payload) until the server closes it."""
    def exactly(n: int) -> bytes | None:
        out = b""
        while len(out) < n:
            more = sock.recv(n - len(out))
            if not more:
                assert not out, "the data connection closed mid-record"
                return None
            out += more
        return out

    while (length := exactly(4)) is not None:
        head = pb.BatchFrame.FromString(exactly(int.from_bytes(length, "little")) or b"")
        if head.via_socket:
            assert head.payload_bytes == 0 or exactly(head.payload_bytes) is not None
        into.append(head)


def answered(requests: list[pb.StreamRequest], frames: list[pb.BatchFrame]) -> None:
    """A call that ended OK answered every credit once."""
    credits = sorted(i for r in requests for i in r.batch_indices)
    got = sorted(f.batch_index for f in frames if not f.HasField("data_socket")
                 and (f.offset == 0 or f.HasField("error")))
    assert got == credits


def sample_indices(server: Any) -> list[int]:
    with RemoteLoader(server.address, "toy", batch_size=8, seed=5, output="numpy",
                      timeout=60, shared_memory=False) as loader:
        return np.concatenate([b["sample_index"] for b in loader]).tolist()


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module(DATASETS, workers=1, server={"max_credits": MAX_CREDITS})


@pytest.fixture(scope="module")
def baseline(server) -> list[int]:
    """One epoch before any fuzzing: the answer the server must still give afterwards."""
    got = sample_indices(server)
    assert sorted(got) == sorted(set(got)) and len(got) == N - N % 8
    return got


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


def fuzz(examples: int, strategy: st.SearchStrategy, body: Callable[[Any], str]) -> dict:
    """Run `body` on `examples` generated inputs; {outcome: count} of what it returned."""
    outcomes: dict[str, int] = {}

    @settings(FUZZ, max_examples=examples)
    @given(strategy)
    def inner(value: Any) -> None:
        outcome = body(value)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    inner()
    return outcomes


def summary(outcomes: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))


def test_stream_requests(server, baseline, channel, ledger) -> None:
    def body(requests: list[pb.StreamRequest]) -> str:
        try:
            frames = run_stream(channel, requests)
        except grpc.RpcError as e:
            return check_status(e)
        answered(requests, frames)
        return "OK"

    outcomes = fuzz(200, stream_requests(), body)
    ledger.record("bad requests", "StreamBatches: generated StreamRequest sequences (every "
                  "field, int64 extremes, NaN reports, bad probes, unicode names)",
                  tried=sum(outcomes.values()), detail=summary(outcomes))
    assert outcomes.get("OK", 0) > 10  # the generator reaches the batches too


def test_describe_and_list(server, channel, ledger) -> None:
    stub = pb_grpc.DataServiceStub(channel)

    def body(c: pb.Coordinates | None) -> str:
        request = pb.DescribeDatasetRequest() if c is None else pb.DescribeDatasetRequest(
            coordinates=c)
        try:
            answer = stub.DescribeDataset(request, timeout=DEADLINE)
        except grpc.RpcError as e:
            return check_status(e)
        assert answer.dataset == c.dataset and answer.num_samples in (N, 40)
        assert answer.batches_per_epoch >= 0 and answer.samples_per_rank >= 0
        return "OK"

    outcomes = fuzz(120, st.one_of(st.none(), coordinates()), body)
    listed = stub.ListDatasets(pb.ListDatasetsRequest(), timeout=DEADLINE)
    assert [d.name for d in listed.datasets] == ["flaky", "toy"]
    ledger.record("bad requests", "DescribeDataset: generated coordinates (absent, unknown "
                  "and unicode datasets, int64 extremes)", tried=sum(outcomes.values()),
                  detail=summary(outcomes))


# Garbage as a serialized request: random bytes, truncated and corrupted valid messages,
# unknown fields, a string field holding invalid UTF-8.
GOOD = pb.StreamRequest(coordinates=pb.Coordinates(dataset="toy", world_size=1, batch_size=4),
                        batch_indices=[0, 1]).SerializeToString()
GARBAGE = st.one_of(
    st.binary(max_size=200),
    st.integers(1, len(GOOD) - 1).map(lambda n: GOOD[:n]),
    st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)).map(
        lambda t: GOOD[: t[0]] + bytes([t[1]]) + GOOD[t[0] + 1 :]),
    st.sampled_from([
        GOOD + b"\xf8\x06\x01",                      # unknown field 111, varint
        GOOD + b"\x9a\x06\x03abc",                    # unknown field 99, bytes
        b"\x0a\x04\x0a\x02\xff\xfe",                  # coordinates.dataset: invalid UTF-8
        b"\x22\x02\xc3\x28",                          # released: invalid UTF-8
        b"\x12\x0a" + b"\xff" * 10,                   # batch_indices: a varint too long
        b"\x0a\xff\xff\xff\xff\x0f",                  # a length past the end
        b"\x0a\x02\x08",                              # truncated nested message
    ]))


def test_garbage_bytes_as_requests(server, channel, ledger) -> None:
    unary = {name: channel.unary_unary(SERVICE + name) for name in ("ListDatasets",
                                                                     "DescribeDataset")}
    streams = channel.stream_stream(SERVICE + "StreamBatches")

    def body(case: tuple[str, list[bytes]]) -> str:
        method, payloads = case
        try:
            if method == "StreamBatches":
                for raw in streams(iter(payloads), timeout=DEADLINE):
                    pb.BatchFrame.FromString(raw)  # well-formed
            else:
                raw = unary[method](payloads[0], timeout=DEADLINE)
                answer = (pb.ListDatasetsResponse if method == "ListDatasets"
                          else pb.DescribeDatasetResponse).FromString(raw)
                assert method == "ListDatasets" or answer.dataset
        except grpc.RpcError as e:
            return f"{method} {check_status(e)}"
        return f"{method} OK"

    case = st.tuples(st.sampled_from(["ListDatasets", "DescribeDataset", "StreamBatches"]),
                     st.lists(GARBAGE, min_size=1, max_size=3))
    outcomes = fuzz(120, case, body)
    ledger.record("bad requests", "random and corrupted bytes as the serialized request "
                  "(all three methods)", tried=sum(outcomes.values()), detail=summary(outcomes))


def test_a_request_over_the_size_limit(server, channel, ledger) -> None:
    """Past the server's receive limit (max_request_bytes, 1 MiB by default): RESOURCE_EXHAUSTED
    from gRPC itself; too many credits: RESOURCE_EXHAUSTED from the server. Either way the
    server goes on (the last test checks it still serves exactly)."""
    huge = [pb.StreamRequest(coordinates=pb.Coordinates(dataset="toy", world_size=1,
                                                        batch_size=4),
                             released=["x" * 1000] * 5000)]  # about 5 MB
    with pytest.raises(grpc.RpcError) as info:
        run_stream(channel, huge)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    many = [pb.StreamRequest(coordinates=pb.Coordinates(dataset="toy", world_size=1,
                                                        batch_size=4),
                             batch_indices=[0] * 100_000)]  # under 1 MiB, 100k credits
    with pytest.raises(grpc.RpcError) as info:
        run_stream(channel, many)
    assert check_status(info.value) == "RESOURCE_EXHAUSTED"
    assert info.value.details().startswith("batch_indices: 100000 credits")
    ledger.record("bad requests", "a 5 MB request; 100,000 credits in one message", tried=2,
                  detail="RESOURCE_EXHAUSTED")



def test_still_serves_exactly_after_the_fuzzing(server, baseline, ledger) -> None:
    # Module order: runs after the fuzz tests above (pytest keeps file order).
    got = sample_indices(server)
    lost, dup = ledger.compare(got, baseline)
    ledger.record("bad requests", "one epoch after all the generated bad requests", tried=1,
                  lost=lost, duplicated=dup, detail="same sample indices, same order")
    assert got == baseline
    # The server logs the user's own tracebacks (the flaky dataset's), never one of its own:
    # a frame in stoker's server code would be a crash or an unhandled error.
    ours = str(Path(stoker.server.__file__).parent)
    crashes = [ln for ln in server.stderr.splitlines() if ln.strip().startswith(f'File "{ours}')]
    assert not crashes, server.stderr
