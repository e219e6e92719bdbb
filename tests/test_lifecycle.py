"""Start, health, and graceful shutdown on real signals."""

from __future__ import annotations

import json
import queue
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.v1 import stoker_pb2 as pb

from conftest import TOY_DATASETS, server_env

SHM = Path("/dev/shm")


def segments(server: ServerProcess) -> list[str]:
    """The shared-memory segments a server's workers made that still exist."""
    assert server.proc is not None
    return [p.name for p in SHM.glob(f"stoker_{server.proc.pid}_*")]


def start(tmp_path: Path, **server: object) -> ServerProcess:
    config = write_config(tmp_path / "config.yaml",
                          {"server": server, "datasets": {"toy": TOY_DATASETS["toy"]}})
    return ServerProcess(config, workers=2, env=server_env()).start()


def test_healthz_answers_on_the_http_port(tmp_path: Path) -> None:
    with start(tmp_path) as server:
        with urllib.request.urlopen(f"{server.http_url}/healthz", timeout=30) as resp:
            assert resp.status == 200 and json.load(resp) == {"status": "ok"}


def wait_for_segments(server: ServerProcess, timeout: float = 30.0) -> list[str]:
    """Probe the server's /metrics until it has built two batches (the client reads only the
    first, so the second waits in shared memory), then list the segments. Bounded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as resp:
            built = sum(float(line.split()[-1]) for line in resp.read().decode().splitlines()
                        if line.startswith("stoker_batch_build_seconds_count"))
        if built >= 2 and (found := segments(server)):
            return found
    raise AssertionError("no batch ever waited in shared memory")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_frees_shared_memory(tmp_path: Path, sig: int) -> None:
    big = {"format": "python", "factory": "toy_datasets:Noise",
           "options": {"n": 40, "shape": [512, 512]}}  # 1 MiB samples, 4 MiB batches
    config = write_config(tmp_path / "config.yaml",
                          {"server": {"grace_seconds": 1}, "datasets": {"big": big}})
    server = ServerProcess(config, workers=2, env=server_env()).start()
    coords = pb.Coordinates(dataset="big", seed=0, epoch=0, shuffle=False, rank=0,
                            world_size=1, batch_size=4, drop_last=True)
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = channel.stream_stream(
                "/stoker.v1.DataService/StreamBatches",
                request_serializer=pb.StreamRequest.SerializeToString)(iter([pb.StreamRequest(
                    coordinates=coords, batch_indices=list(range(10)))]), timeout=60)
            next(call)  # then read no more: flow control holds built batches at the server
            assert SHM.is_dir() and wait_for_segments(server)
            code = server.stop(sig)
    finally:
        if server.proc and server.proc.poll() is None:
            server.stop()
    assert code == 0, server.stderr
    assert json.loads(server.stdout[-1]) == {"event": "stopped"}
    assert segments(server) == []


def wait_until_refused(address: str, timeout: float = 30.0) -> grpc.StatusCode:
    """Open new calls until the draining server refuses one (bounded in time)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.RpcError as e:
                # A call racing the server's GOAWAY may end CANCELLED; later ones find the
                # port closed (UNAVAILABLE), which the caller checks.
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    return e.code()
                raise
    raise AssertionError("the server kept accepting new calls while draining")


def test_sigterm_finishes_batches_in_flight_and_refuses_new_work(tmp_path: Path) -> None:
    slow = {**TOY_DATASETS["toy"], "options": {"n": 20, "delay": 0.2}}
    config = write_config(tmp_path / "config.yaml",
                          {"server": {"grace_seconds": 60}, "datasets": {"slow": slow}})
    server = ServerProcess(config, workers=1, env=server_env()).start()
    coords = pb.Coordinates(dataset="slow", seed=0, epoch=0, shuffle=False, rank=0,
                            world_size=1, batch_size=1, drop_last=True)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    requests.put(pb.StreamRequest(coordinates=coords, batch_indices=[0, 1, 2]))
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream("/stoker.v1.DataService/StreamBatches",
                                     request_serializer=pb.StreamRequest.SerializeToString)(
            iter(requests.get, None), timeout=60)
        frames = iter(call)
        first = pb.BatchFrame.FromString(next(frames))  # the server has all three credits
        server.proc.send_signal(signal.SIGTERM)
        wait_until_refused(server.address)
        with pytest.raises(RemoteError) as refused:
            list(RemoteLoader(server.address, "slow", batch_size=1, timeout=2))
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        requests.put(pb.StreamRequest(batch_indices=[3]))  # asked after the signal
        answers = {first.batch_index: first}
        while len(answers) < 4:
            frame = pb.BatchFrame.FromString(next(frames))
            answers[frame.batch_index] = frame
        stopping = time.monotonic()
        requests.put(None)
        call.cancel()
    # The batches in flight were finished; the one asked later was refused, in-band.
    assert all(not answers[i].HasField("error") for i in (0, 1, 2))
    assert answers[3].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    # The client let go: the server need not wait out its 60 s grace period.
    assert server.stop() == 0, server.stderr
    assert time.monotonic() - stopping < 30
