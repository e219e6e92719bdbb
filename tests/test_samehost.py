"""Same-host delivery: a client on the server's host reads batches from shared memory."""

from __future__ import annotations

import secrets
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from epochs import epoch

from stoker.client.transport.samehost import probe
from stoker.v1 import stoker_pb2 as pb

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")]

NOISE = {"noise": {"format": "python", "factory": "toy_datasets:Noise",
                   "options": {"n": 12, "shape": [64, 64]}}}


def raw_stream(address: str, indices: list[int], shm_probe: Any = None,
               hold: threading.Event | None = None) -> Any:
    """A StreamBatches call; with `hold`, the request side stays open until it is set."""
    coords = pb.Coordinates(dataset="noise", seed=0, epoch=0, shuffle=False, rank=0,
                            world_size=1, batch_size=3, drop_last=True)
    channel = grpc.insecure_channel(address)
    method = channel.stream_stream("/stoker.v1.DataService/StreamBatches",
                                   request_serializer=pb.StreamRequest.SerializeToString,
                                   response_deserializer=pb.BatchFrame.FromString)
    first = pb.StreamRequest(coordinates=coords, batch_indices=indices, shm_probe=shm_probe)

    def requests() -> Iterator[pb.StreamRequest]:
        yield first
        if hold is not None:
            hold.wait(60)

    return channel, method(requests(), timeout=60)


def open_streams(server: Any) -> float:
    """stoker_active_streams of the noise dataset, from the server's /metrics."""
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('stoker_active_streams{dataset="noise"}'):
                return float(line.split()[-1])
    return 0.0


def kept_bytes(server: Any) -> float:
    """stoker_shared_kept_bytes, from the server's /metrics."""
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("stoker_shared_kept_bytes "):
                return float(line.split()[-1])
    raise AssertionError("no stoker_shared_kept_bytes in /metrics")




def test_shared_memory_batches_equal_socket_batches(start_server) -> None:
    server = start_server(NOISE, workers=2)
    via_shm, via_socket = (epoch(server, "noise", batch_size=3),
                           epoch(server, "noise", batch_size=3, shared_memory=False))
    via_shm, via_socket = ({**e.arrays(), "bytes": np.array(e.stats["bytes"])}
                           for e in (via_shm, via_socket))
    for k in via_socket:
        if k != "bytes":
            assert np.array_equal(via_shm[k], via_socket[k]), k
    # Stats count the payload either way: 4 batches of 3 x 64 x 64 float32 at least.
    assert via_shm["bytes"] >= 4 * 3 * 64 * 64 * 4 and via_socket["bytes"] >= 4 * 3 * 64 * 64 * 4


def test_the_server_names_segments_only_to_a_client_that_proves_it_shares_the_host(
        start_server) -> None:
    server = start_server(NOISE)
    good = probe()
    assert good is not None
    cases = {"good": good,
             "wrong token": pb.SharedMemoryProbe(name=good.name, token=secrets.token_bytes(16)),
             "a path": pb.SharedMemoryProbe(name="../../etc/passwd", token=good.token),
             "missing": pb.SharedMemoryProbe(name=f"stoker_client_1_{'0' * 32}",
                                             token=good.token),
             "none": None}
    for case, shm_probe in cases.items():
        channel, call = raw_stream(server.address, [0], shm_probe)
        with channel:
            frame = next(call)
        assert frame.payload_bytes > 0 and not frame.HasField("error"), case
        if case == "good":
            assert frame.shm_name.startswith("stoker_") and frame.data == b""
        else:
            assert frame.shm_name == "" and len(frame.data) > 0, case
    assert "Traceback" not in server.stderr


def test_a_server_configured_without_shared_memory_sends_bytes(start_server) -> None:
    server = start_server(NOISE, server={"shared_memory": False})
    channel, call = raw_stream(server.address, [0], probe())
    with channel:
        frame = next(call)
    assert frame.shm_name == "" and len(frame.data) > 0


def test_segments_a_client_never_released_are_unlinked_when_its_stream_ends(
        start_server) -> None:
    # No batches kept for later jobs (they would be unlinked when the server lets go of them).
    server = start_server(NOISE, cache={"shared_batches": 0})
    hold = threading.Event()
    channel, call = raw_stream(server.address, [0, 1, 2], probe(), hold)
    with channel:
        names = [next(call).shm_name for _ in range(3)]  # read, never released
        assert all((Path("/dev/shm") / n).exists() for n in names), names
        call.cancel()
        hold.set()
    # The stream's end runs on the server's event loop: it unlinks the segments, then counts
    # the stream closed. Wait on that probe (/metrics), boundedly.
    deadline = time.monotonic() + 30
    while open_streams(server) and time.monotonic() < deadline:
        pass
    assert open_streams(server) == 0
    assert not any((Path("/dev/shm") / n).exists() for n in names)
    # ...and the server goes on serving, over shared memory.
    assert len(epoch(server, "noise", batch_size=3).indices()) == 12


def test_a_batch_asked_twice_on_one_stream_is_let_go_twice(start_server) -> None:
    # One stream credits batch 0 twice: both answers name one segment (one build, shared),
    # lent twice. Once the stream ends and the server stops keeping the batch for other
    # jobs, nothing holds it: unlinked. (Lent segments were kept by name, once: the second
    # reference was never released and the segment stayed for the server's life.)
    server = start_server(NOISE, cache={"shared_seconds": 1})
    hold = threading.Event()
    channel, call = raw_stream(server.address, [0, 0], probe(), hold)
    with channel:
        names = [next(call).shm_name for _ in range(2)]  # read, never released
        assert names[0] == names[1] != "", names
        call.cancel()
        hold.set()
    deadline = time.monotonic() + 30
    while (open_streams(server) or kept_bytes(server)) and time.monotonic() < deadline:
        pass
    assert open_streams(server) == 0 and kept_bytes(server) == 0
    assert not (Path("/dev/shm") / names[0]).exists()
