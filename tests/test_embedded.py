"""serve() embedded in a program, as a task in its loop: cancelled, or failing late in its
start, it leaves nothing behind in that program (tests/embedded_server.py is the program)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stoker.server import write_config
from stoker.v1 import stoker_pb2 as pb

from conftest import TESTS, server_env

SHM = Path("/dev/shm")
BIG = {"format": "python", "factory": "toy_datasets:Noise",
       "options": {"n": 40, "shape": [512, 512]}}  # 1 MiB samples, 4 MiB batches


class Program:
    """The embedding program in a child process; its JSON lines, read as they come."""

    def __init__(self, config: Path) -> None:
        self.log = config.with_name("stderr.txt")  # a file: a full pipe would block the program
        with self.log.open("w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(TESTS / "embedded_server.py"), str(config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                env={**os.environ, **server_env()})

    def event(self) -> dict[str, Any]:
        """The next JSON line the program (or serve() inside it) printed."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.proc.wait(30)
        raise AssertionError(f"the program exited ({self.proc.returncode}) "
                             f"without reporting\n{self.log.read_text()}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def segments(self) -> list[str]:
        return [p.name for p in SHM.glob(f"stoker_{self.proc.pid}_*")]

    def end(self) -> None:
        """Close its input: the program ends, and must end cleanly."""
        self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, self.log.read_text()


@pytest.fixture
def program(tmp_path: Path) -> Iterator[Any]:
    started: list[Program] = []

    def start(server: dict[str, Any]) -> Program:
        config = write_config(tmp_path / "config.yaml",
                              {"server": {"port": 0, "http_port": 0, "workers": 2, **server},
                               "datasets": {"big": BIG}})
        started.append(Program(config))
        return started[-1]

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.communicate()


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False


def assert_nothing_left(report: dict[str, Any]) -> None:
    before, after = report["before"], report["after"]
    assert after["listening"] == before["listening"] == []
    # The threads serve() starts are named stoker-*; others belong to the program's loop
    # (its default executor), to gRPC's and AnyIO's process-wide pools.
    assert [t for t in after["threads"] if t.startswith("stoker-")] == []
    assert after["children"] == before["children"]
    assert after["signals"] == before["signals"]
    assert after["loop_handlers"] == []


def wait_for_segments(program: Program, http_url: str, timeout: float = 30.0) -> list[str]:
    """Probe /metrics until two batches were built (the stream reads only the first, so the
    second waits in shared memory), then list the segments. Bounded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{http_url}/metrics", timeout=10) as resp:
            built = sum(float(line.split()[-1]) for line in resp.read().decode().splitlines()
                        if line.startswith("stoker_batch_build_seconds_count"))
        if built >= 2 and (found := program.segments()):
            return found
    raise AssertionError("no batch ever waited in shared memory")


def test_cancelled_serve_leaves_no_port_thread_process_segment_or_handler(program) -> None:
    p = program({})
    ready = p.event()
    assert ready["event"] == "ready", ready
    ports = {"gRPC": ready["grpc_port"], "HTTP": ready["http_port"],
             "data socket": ready["data_port"]}
    http_url = f"http://127.0.0.1:{ready['http_port']}"
    address = f"127.0.0.1:{ready['grpc_port']}"
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with urllib.request.urlopen(f"{http_url}/readyz", timeout=30) as resp:
            assert resp.status == 200
        # A stream with batches in flight when the server goes: read one, leave the rest in
        # shared memory (flow control holds them at the server).
        coords = pb.Coordinates(dataset="big", seed=0, epoch=0, shuffle=False, rank=0,
                                world_size=1, batch_size=4, drop_last=True)
        call = channel.stream_stream(
            "/stoker.v1.DataService/StreamBatches",
            request_serializer=pb.StreamRequest.SerializeToString)(iter([pb.StreamRequest(
                coordinates=coords, batch_indices=list(range(10)))]), timeout=60)
        next(call)
        assert wait_for_segments(p, http_url)

        p.send("cancel")
        report = p.event()
        assert report["event"] == "cancelled", report
        assert "error" not in report, report["error"]
        assert_nothing_left(report)
        assert {what: port for what, port in ports.items() if not refused(port)} == {}
        assert p.segments() == []
        with pytest.raises(grpc.RpcError):
            for _ in call:  # what reached this end before the server went, then its end
                pass
    p.end()


def test_a_start_that_fails_at_its_last_step_leaves_nothing(program) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        http_port = taken.getsockname()[1]
        p = program({"http_port": http_port})
        report = p.event()
    assert report["event"] == "failed", report
    assert report["error"] == (f"StartError: cannot listen on 127.0.0.1:{http_port} (HTTP): "
                               "Address already in use")
    assert_nothing_left(report)
    assert p.segments() == []
    p.end()


def test_serve_cancelled_while_its_workers_start_leaves_nothing(program) -> None:
    p = program({})
    p.send("cancel")  # at once: the workers take seconds to open the dataset
    report = p.event()
    assert report["event"] == "cancelled", report
    assert "error" not in report, report["error"]
    assert_nothing_left(report)
    assert p.segments() == []
    p.end()
