"""Start, health, and graceful shutdown on real signals."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess, write_config

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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_frees_shared_memory(tmp_path: Path, sig: int) -> None:
    server = start(tmp_path)
    try:
        with RemoteLoader(server.address, "toy", batch_size=4, output="numpy",
                          timeout=60) as loader:
            for k, _ in enumerate(loader):
                if k == 3:
                    # Batches credited ahead now wait in shared memory, named for this server.
                    assert SHM.is_dir() and segments(server)
                    break
    finally:
        code = server.stop(sig)
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


def test_sigterm_drains_streams_in_flight_and_refuses_new_ones(tmp_path: Path) -> None:
    server = start(tmp_path, grace_seconds=60)
    with RemoteLoader(server.address, "toy", batch_size=1, prefetch=2, shuffle=False,
                      output="numpy", timeout=60) as loader:
        got = []
        it = iter(loader)
        got.append(next(it)["sample_index"][0])
        server.proc.send_signal(signal.SIGTERM)
        wait_until_refused(server.address)
        with pytest.raises(RemoteError) as refused:
            list(RemoteLoader(server.address, "toy", batch_size=1, timeout=30))
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        got += [b["sample_index"][0] for b in it]  # the stream in flight finishes its epoch
    assert got == list(range(103))
    assert server.stop() == 0, server.stderr
