"""data_socket=True: payloads on a plain TCP connection beside the gRPC stream."""

from __future__ import annotations

import queue
import secrets
import socket
import struct
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from epochs import epoch

from stoker.client import RemoteLoader
from stoker.client.transport.frames import Assembler
from stoker.server.front.data_listener import MAX_CLAIMS, TOKEN_WAIT
from stoker.server.pool.depth import KEEP_SEGMENTS
from stoker.v1 import stoker_pb2 as pb

pytestmark = pytest.mark.timeout(120)

NOISE = {"noise": {"format": "python", "factory": "toy_datasets:Noise",
                   "options": {"n": 12, "shape": [64, 64]}}}


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module(NOISE, workers=2)


READ = {"batch_size": 3, "shared_memory": False}  # every epoch() here


def test_data_socket_batches_equal_frame_batches(server) -> None:
    framed = epoch(server, "noise", **READ).arrays()
    socketed = epoch(server, "noise", data_socket=True, **READ).arrays()
    for k in framed:
        assert framed[k].dtype == socketed[k].dtype and np.array_equal(framed[k], socketed[k])


def stream(server, indices: list[int]) -> tuple[grpc.Channel, Any]:
    coords = pb.Coordinates(dataset="noise", seed=0, epoch=0, shuffle=False, rank=0,
                            world_size=1, batch_size=3, drop_last=True)
    channel = grpc.insecure_channel(server.address)
    call = channel.stream_stream(
        "/stoker.v1.DataService/StreamBatches",
        request_serializer=pb.StreamRequest.SerializeToString,
        response_deserializer=pb.BatchFrame.FromString)(iter([pb.StreamRequest(
            coordinates=coords, batch_indices=indices, data_socket=True)]), timeout=60)
    return channel, call


def test_the_offer_comes_first_and_a_client_that_never_connects_gets_frames(server) -> None:
    channel, call = stream(server, [0])
    with channel:
        offer = next(call)
        assert offer.WhichOneof("kind") == "data_socket" and offer.data_socket.port > 0
        assert len(offer.data_socket.token) == 16
        # Never connect: after a few seconds the server sends the payload in frames.
        batch = next(call)
    assert batch.batch_index == 0 and not batch.via_socket and len(batch.data) > 0


def test_a_connection_with_a_wrong_token_is_dropped_and_learns_nothing(server) -> None:
    port = server.ready["data_port"]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(secrets.token_bytes(16))
        assert sock.recv(1024) == b""  # closed by the server, nothing sent
    assert len(epoch(server, "noise", data_socket=True, **READ).indices()) == 12  # still serving


def test_silent_connections_beyond_the_cap_are_closed_and_serving_goes_on(server,
                                                                         ledger) -> None:
    port = server.ready["data_port"]
    silent = [socket.create_connection(("127.0.0.1", port), timeout=30)
              for _ in range(MAX_CLAIMS)]
    try:
        # Over the cap (per address, and in all): the OLDEST is closed at once, not held for
        # the TOKEN_WAIT a claim gets; the newest, which may be a real client, stays.
        silent[0].settimeout(TOKEN_WAIT / 2)
        assert silent[0].recv(1) == b""
    finally:
        for sock in silent:
            sock.close()
    got = epoch(server, "noise", data_socket=True, **READ).arrays()["sample_index"]  # still serving
    lost, dup = ledger.compare(got.tolist(), range(12))
    ledger.record("security", "data socket: connections that never send a token, past the cap",
                  tried=MAX_CLAIMS, lost=lost, duplicated=dup,
                  detail="the oldest closed at once; served on")
    assert lost == dup == 0


def test_segments_go_back_to_the_workers_after_the_socket_sends_them(start_server) -> None:
    # No batches kept for other jobs: every segment left is a worker's, or a leak.
    server = start_server(NOISE, workers=2, cache={"shared_batches": 0})
    pid = server.proc.pid
    epochs = 2 * KEEP_SEGMENTS // 4 + 4  # x 4 batches: a leak of one a batch would show
    with RemoteLoader(server.address, "noise", batch_size=3, output="numpy", timeout=60,
                      shared_memory=False, data_socket=True) as loader:
        for e in range(epochs):  # each epoch's batches are new ones
            loader.set_epoch(e)
            assert len(list(loader)) == 4
        assert loader.stats()["transport"] == "data_socket"
    held = list(Path("/dev/shm").glob(f"stoker_{pid}_*"))
    assert len(held) <= 2 * KEEP_SEGMENTS < epochs * 4  # the two workers' pools, nothing more


def test_credits_on_the_data_connection_are_answered_there_and_a_bad_record_ends_the_call(
        server, ledger) -> None:
    coords = pb.Coordinates(dataset="noise", seed=0, epoch=0, shuffle=False, rank=0,
                            world_size=1, batch_size=3, drop_last=True)
    requests: queue.SimpleQueue[pb.StreamRequest | None] = queue.SimpleQueue()
    requests.put(pb.StreamRequest(coordinates=coords, data_socket=True))  # no credit in gRPC
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(
            "/stoker.v1.DataService/StreamBatches",
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.BatchFrame.FromString)(iter(requests.get, None),
                                                             timeout=60)
        try:
            offer = next(call).data_socket
            assert offer.credits  # plain TCP: the server reads credits there
            with socket.create_connection(("127.0.0.1", offer.port), timeout=30) as sock:
                sock.sendall(offer.token)
                # Two records, the second cut in two: batches 0, 1 and 3.
                sock.sendall(struct.pack("<Iqq", 2, 0, 1) + struct.pack("<I", 1))
                sock.sendall(struct.pack("<q", 3))
                assembler = Assembler(lambda n: (None, np.empty(n, np.uint8)))
                got = sorted(assembler.receive(sock).batch_index for _ in range(3))
                assert got == [0, 1, 3]
                sock.sendall(struct.pack("<I", 0))  # a record of no credit: refused
                with pytest.raises(grpc.RpcError) as refused:
                    next(call)
        finally:
            requests.put(None)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "credit record of 0 batch indices" in refused.value.details()
    ledger.record("bad requests", "data connection: a credit record of 0 indices after good "
                  "ones", tried=1, detail="good credits answered on the connection; the bad "
                  "record ended the call with INVALID_ARGUMENT")
