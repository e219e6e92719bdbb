"""The data connection, the default path between machines: who gets a byte of a batch, how
fast a client that cannot reach it falls back to frames, and a connection cut mid-batch.
(TLS and mutual TLS on it: tests/test_security.py, beside the other TLS tests.)"""

from __future__ import annotations

import hashlib
import hmac
import logging
import signal
import socket
import struct
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
from epochs import epoch

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.v1 import stoker_pb2 as pb

from conftest import server_env
from tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(120)

TOKEN = "wire-test-token-" + "0123456789ab"
NOISE = {"noise": {"format": "python", "factory": "toy_datasets:Noise",
                   "options": {"n": 12, "shape": [64, 64]}}}
# Batches of 4 x 256 KiB: a kill lands mid-payload more often than not.
BIG = {"big": {"format": "python", "factory": "toy_datasets:Noise",
               "options": {"n": 96, "shape": [256, 256]}}}


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STOKER_TOKEN", raising=False)


@pytest.fixture(scope="module")
def auth_server(start_server_module, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    return start_server_module(NOISE, server={"auth_token_file": str(token_file)})


READ = {"batch_size": 3, "shuffle": False, "shared_memory": False}  # every epoch() here


def offer(server: Any, metadata: Any) -> tuple[grpc.Channel, Any, pb.DataSocket]:
    """A raw stream with one credit and its data connection's offer."""
    channel = grpc.insecure_channel(server.address)
    call = channel.stream_stream(
        "/stoker.v1.DataService/StreamBatches",
        request_serializer=pb.StreamRequest.SerializeToString,
        response_deserializer=pb.BatchFrame.FromString)(iter([pb.StreamRequest(
            coordinates=pb.Coordinates(dataset="noise", seed=0, epoch=0, rank=0, world_size=1,
                                       batch_size=3, drop_last=True),
            batch_indices=[0], data_socket=True)]), timeout=60, metadata=metadata)
    first = next(call)
    assert first.HasField("data_socket")
    return channel, call, first.data_socket


def nothing_sent(sock: socket.socket) -> bool:
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def test_the_default_path_between_machines_is_the_data_connection(auth_server) -> None:
    framed = epoch(auth_server, "noise", token=TOKEN, data_socket=False, **READ)
    got = epoch(auth_server, "noise", token=TOKEN, **READ)
    stats = got.stats
    assert stats["transport"] == "data_socket", stats["transports"]
    assert stats["transports"][auth_server.address]["why"] == "plain TCP"
    for a, b in zip(framed, got, strict=True):
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k])


def test_a_claim_without_the_bearer_tokens_proof_gets_no_byte(auth_server, ledger) -> None:
    """The claim token only goes out on an authenticated stream; with a bearer token the
    server also wants its proof. Connections with the token alone, a wrong proof, or
    another stream's proof get nothing; the right claim gets the batch."""
    channel, call, data = offer(auth_server, [("authorization", f"Bearer {TOKEN}")])
    with channel:
        assert data.proof and len(data.token) == 16
        port, token = data.port, bytes(data.token)
        good = hmac.new(TOKEN.encode(), token, hashlib.sha256).digest()
        bad = [token, token + bytes(32), token + hmac.new(b"x" * 16, token, "sha256").digest(),
               bytes(16) + good]
        for claim in bad:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(claim)
                if len(claim) < 48:
                    sock.shutdown(socket.SHUT_WR)
                assert nothing_sent(sock), claim[:20]
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(token + good)
            n = struct.unpack("<I", recv(sock, 4))[0]
            head = pb.BatchFrame.FromString(recv(sock, n))
            assert head.via_socket and head.batch_index == 0
            assert len(recv(sock, head.payload_bytes)) == head.payload_bytes
        call.cancel()
    ledger.record("security", "data connection: claims without the bearer token's proof "
                  "(token alone, zero proof, another key's proof, wrong token)", tried=len(bad),
                  detail="each closed with no byte sent; the right claim got its batch")


def recv(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        more = sock.recv(n - len(out))
        assert more, f"closed after {len(out)} of {n} bytes"
        out += more
    return bytes(out)


def test_an_unreachable_data_port_falls_back_to_frames_at_once(start_server, ledger,
                                                               caplog) -> None:
    """gRPC through a proxy on 127.0.0.2; the offered data port is dialled there, where
    nothing listens: refused. The first batch comes in frames within 0.5 s of a normal
    first batch, and the loader says so once, in the log and in stats()."""
    server = start_server(NOISE)
    with TcpProxy(server.address, host="127.0.0.2") as proxy:
        t0 = time.perf_counter()
        with RemoteLoader(proxy.address, "noise", batch_size=3, output="numpy",
                          shared_memory=False, data_socket=False, timeout=30) as loader:
            next(iter(loader))
        normal = time.perf_counter() - t0
        caplog.set_level(logging.WARNING, logger="stoker.client")
        t0 = time.perf_counter()
        with RemoteLoader(proxy.address, "noise", batch_size=3, output="numpy",
                          shared_memory=False, timeout=30) as loader:
            it = iter(loader)
            next(it)
            first = time.perf_counter() - t0
            rest = [b["sample_index"].tolist() for b in it]
            stats = loader.stats()
    assert stats["transport"] == "frames", stats["transports"]
    assert "cannot be reached" in stats["transports"][proxy.address]["why"]
    warned = [r for r in caplog.records if "gRPC frames" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert first <= normal + 0.5 + 0.25, (first, normal)  # the budget, and some noise
    assert len(rest) == 3
    ledger.record("network", "data port unreachable (refused): fallback to frames",
                  detail=f"first batch in {first:.2f} s (frames alone: {normal:.2f} s); one "
                         "warning; stats()['transport'] == 'frames'")


def test_a_server_killed_mid_batch_loses_and_repeats_nothing(tmp_path, ledger) -> None:
    """Two servers, batches of 1 MiB on their data connections; one is killed (SIGKILL)
    while its payloads are in flight: the other answers what it owed."""
    config = write_config(tmp_path / "config.yaml", {"datasets": BIG})
    with ServerProcess(config, workers=1, env=server_env()) as a, \
            ServerProcess(config, workers=1, env=server_env()) as b:
        killed_mid_epoch([a, b], ledger)


def killed_mid_epoch(servers: list[ServerProcess], ledger: Any) -> None:
    victim = servers[0]
    got: list[int] = []
    killed = threading.Event()
    with RemoteLoader([s.address for s in servers], "big", batch_size=4, output="numpy",
                      shared_memory=False, shuffle=False, prefetch=4, timeout=60) as loader:
        for k, batch in enumerate(loader):
            got += batch["sample_index"].tolist()
            if k == 3:
                victim.proc.send_signal(signal.SIGKILL)
                killed.set()
        stats = loader.stats()
    assert killed.is_set()
    lost, dup = ledger.compare(got, range(96))
    ledger.record("servers", "SIGKILL one of 2 mid-epoch, 1 MiB batches on the data "
                  "connection", lost=lost, duplicated=dup,
                  detail=f"{stats['failovers']} failovers")
    assert lost == dup == 0 and got == list(range(96))
    assert stats["transports"][servers[1].address]["transport"] == "data_socket"
