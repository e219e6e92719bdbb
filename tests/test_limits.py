"""Bounded everything in the front end (issue 19): connections, calls held open, shared memory
held by streams, epoch orders, data-port claims, coordinates no rank can serve.

Servers run under `prlimit --nofile=256:256` with small caps, so about 300 sockets show what
took 1,100 at the usual 1024. Attackers connect from 127.0.0.2 (all of 127/8 is loopback), so
the test's own probes and loaders, from 127.0.0.1, are another client.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from epochs import epoch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stoker.client import RemoteError, RemoteLoader
from stoker.server.pool.depth import DEPTH, KEEP_SEGMENTS
from stoker.v1 import stoker_pb2 as pb

from conftest import StartServer, rss_anon

pytestmark = pytest.mark.timeout(60)

PRLIMIT = ["prlimit", "--nofile=256:256", "--"]
ATTACKER = "127.0.0.2"
FLOOD = 300
# The head timeout of the HTTP flood test: long enough that the flood and the check of one
# more connection end before the first held connection is let go, on a loaded 2-core machine.
HEAD_TIMEOUT = 6
TOY = {"toy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 40}}}


def status_kib(pid: int, field: str) -> int:
    """A `field` of /proc/PID/status in KiB (VmRSS, VmHWM: the peak resident set)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_until(check, timeout: float, every: float = 0.05) -> bool:
    """Poll `check` until it is true or `timeout` passes (a bounded wait on a server event
    no callback reports, such as descriptors closed)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def connect_from(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.bind((host, 0))
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def flood(port: int, n: int = FLOOD, send: bytes = b"") -> Iterator[list[socket.socket]]:
    """`n` connections from the attacker's address, each having sent `send` (and no more)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            try:
                sock = connect_from(ATTACKER, port)
            except OSError:
                continue  # refused at once: fine, it holds nothing
            socks.append(sock)
            if send:
                with contextlib.suppress(OSError):  # closed at once by a cap
                    sock.sendall(send)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def read_all(sock: socket.socket) -> bytes:
    got = b""
    with contextlib.suppress(OSError):
        while more := sock.recv(4096):
            got += more
    return got


def toy(address: str, **kw) -> list[int]:
    """An epoch of `toy`: its sample indices."""
    return epoch(address, "toy", batch_size=8, shuffle=False, timeout=20, **kw).indices()


def record_flood(ledger, area: str, case: str, got: list[int], detail: str) -> None:
    """One ledger row for a flood of FLOOD connections, then a loader's epoch of TOY's 40
    samples: it must be exact."""
    lost, dup = ledger.compare(got, range(40))
    ledger.record(area, case, tried=FLOOD, lost=lost, duplicated=dup, detail=detail)
    assert lost == dup == 0


# -- failure 3: connections that never finish, on both ports ----------------------------------
def test_half_sent_http_requests_from_one_address_do_not_take_the_server(
        start_server: StartServer, ledger) -> None:
    server = start_server(TOY, wrap=PRLIMIT, server={
        "max_http_connections": 64, "max_http_connections_per_client": 16,
        "http_header_timeout_seconds": HEAD_TIMEOUT})
    pid, port = server.proc.pid, server.ready["http_port"]
    for _ in range(2):  # the front end's mappings of the workers' segments, kept: the
        toy(server.address)  # first epoch may leave fewer mapped than the next (38 vs 48)
    baseline = open_fds(pid)
    with flood(port, send=b"GET /healthz HTTP/1.1\r\nHost: x\r\n") as socks:
        # One more from the attacker's address, while its 16 are held (they are let go
        # HEAD_TIMEOUT s after they connected): 503 naming the per-client limit, then closed.
        with connect_from(ATTACKER, port) as extra:
            refused = read_all(extra).decode()
        started = time.monotonic()
        with urllib.request.urlopen(server.http_url + "/healthz", timeout=5) as r:
            assert r.status == 200
        took = time.monotonic() - started
        got = toy(server.address)
        # The 16 it holds: 408 naming the head timeout, then closed.
        held = read_all(socks[0]).decode()
    assert wait_until(lambda: open_fds(pid) <= baseline + 8, 10), (open_fds(pid), baseline)
    record_flood(ledger, "http", f"{FLOOD} half-sent request heads from one address (server at "
                 "256 open files)", got, f"/healthz answered in {took * 1000:.0f} ms; the 17th "
                 f"got 503, the first 16 got 408 after {HEAD_TIMEOUT} s; descriptors back to "
                 "the baseline")
    assert took < 1.0
    assert refused.startswith("HTTP/1.1 503") and "max_http_connections_per_client=16" in refused
    assert held.startswith("HTTP/1.1 408") and f"http_header_timeout_seconds={HEAD_TIMEOUT}" in held


def test_http_connections_are_capped_in_all(start_server: StartServer, ledger) -> None:
    server = start_server(TOY, server={"max_http_connections": 8,
                                       "max_http_connections_per_client": 8})
    port = server.ready["http_port"]
    with flood(port, n=8) as socks:
        assert len(socks) == 8
        # A ninth, from another address: 503 naming the server-wide limit.
        with connect_from("127.0.0.3", port) as extra:
            refused = read_all(extra).decode()
    with urllib.request.urlopen(server.http_url + "/healthz", timeout=5) as r:
        assert r.status == 200  # the flood gone, served again
    ledger.record("http", "connections past max_http_connections, from other addresses",
                  detail="503 naming the limit; served again once they closed")
    assert refused.startswith("HTTP/1.1 503") and "max_http_connections=8" in refused


def test_idle_tcp_connections_to_the_grpc_port_do_not_take_the_server(
        start_server: StartServer, ledger) -> None:
    server = start_server(TOY, wrap=PRLIMIT, server={
        "max_grpc_connections": 128, "grpc_handshake_timeout_seconds": 2})
    pid, port = server.proc.pid, server.ready["grpc_port"]
    for _ in range(2):  # the front end's mappings of the workers' segments, kept: the
        toy(server.address)  # first epoch may leave fewer mapped than the next (38 vs 48)
    baseline = open_fds(pid)
    with flood(port):
        started = time.monotonic()
        got = toy(server.address)
        took = time.monotonic() - started
        # Silent connections are closed once the handshake timeout passes.
        assert wait_until(lambda: open_fds(pid) <= baseline + 8, 10), (open_fds(pid), baseline)
    record_flood(ledger, "load", f"{FLOOD} idle TCP connections to the gRPC port (server at 256 "
                 "open files)", got, f"the epoch took {took:.1f} s; silent connections closed "
                 "after grpc_handshake_timeout_seconds=2")


def test_the_server_raises_its_soft_open_file_limit(start_server: StartServer, ledger) -> None:
    server = start_server(TOY, wrap=["prlimit", "--nofile=256:4096", "--"])
    limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
    ledger.record("load", "open-file limit below the hard limit at start",
                  detail="raised to the hard limit; the ready line says so")
    assert line.split()[3:5] == ["4096", "4096"], line
    assert server.ready["nofile"] == 4096
    assert "open files:" not in server.stderr  # the default limits need about 2,100


def test_a_low_open_file_limit_is_named_at_start(start_server: StartServer) -> None:
    server = start_server(TOY, wrap=PRLIMIT)
    assert "open files: the connection limits need about" in server.stderr
    assert "may open 256 (hard limit 256)" in server.stderr


# -- failure 4: health watches ------------------------------------------------------------------
WATCHES = 2000


def test_health_watches_are_bounded_and_counted_per_client(start_server: StartServer,
                                                           ledger) -> None:
    server = start_server(TOY, server={"max_health_watches": 16, "max_streams_per_client": 20})
    pid = server.proc.pid
    request = health_pb2.HealthCheckRequest(service="")
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        warm = stub.Watch(request, timeout=30)
        next(warm)
        warm.cancel()
        baseline = rss_anon(pid)
        held, refused = [], []
        try:
            for _ in range(WATCHES):
                call = stub.Watch(request, timeout=30)
                try:
                    assert next(call).status == health_pb2.HealthCheckResponse.SERVING
                    held.append(call)
                except grpc.RpcError as e:
                    refused.append((e.code(), e.details()))
            grew = rss_anon(pid) - baseline
            # The 16 watches count for this client too: 4 batch streams fit, a fifth does not.
            with RemoteLoader(server.address, "toy", batch_size=8, output="numpy",
                              timeout=20) as ld:
                assert len(list(ld)) == 5
            streams = [raw_stream(channel, hold=True) for _ in range(5)]
            outcomes = []
            for call in streams:
                try:
                    next(call)
                    outcomes.append("open")
                except grpc.RpcError as e:
                    outcomes.append(e.details())
            for call in streams:
                call.cancel()
        finally:
            for call in held:
                call.cancel()
    ledger.record("load", f"{WATCHES} gRPC Health/Watch calls from one client", tried=WATCHES,
                  detail=f"{len(held)} held (max_health_watches=16), the rest "
                         f"RESOURCE_EXHAUSTED naming it; RssAnon +{grew >> 20} MiB")
    assert len(held) == 16 and len(refused) == WATCHES - 16
    assert all(code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_health_watches=16" in said
               for code, said in refused), refused[:3]
    assert grew < 10 << 20, grew
    assert outcomes[:4] == ["open"] * 4
    assert "max_streams_per_client=20" in outcomes[4]


def raw_stream(channel: grpc.Channel, indices: tuple[int, ...] = (0,), hold: bool = False,
               shm_probe=None, dataset: str = "toy", batch_size: int = 8, seed: int = 0):
    """A StreamBatches call; with `hold`, its request side stays open until it is cancelled
    (else it half-closes after its one message). With a `seed`, shuffled."""
    coords = pb.Coordinates(dataset=dataset, seed=seed, shuffle=seed != 0, world_size=1,
                            batch_size=batch_size, drop_last=True)
    first = pb.StreamRequest(coordinates=coords, batch_indices=list(indices),
                             shm_probe=shm_probe)
    never = threading.Event()

    def requests():
        yield first
        if hold:
            never.wait(60)

    method = channel.stream_stream("/stoker.v1.DataService/StreamBatches",
                                   request_serializer=pb.StreamRequest.SerializeToString,
                                   response_deserializer=pb.BatchFrame.FromString)
    return method(requests(), timeout=60)


def test_streams_are_capped_in_all(start_server: StartServer, ledger) -> None:
    server = start_server(TOY, server={"max_streams": 2})
    with grpc.insecure_channel(server.address) as channel:
        open_ = [raw_stream(channel, hold=True) for _ in range(2)]
        try:
            for call in open_:
                next(call)
            with pytest.raises(grpc.RpcError) as err:
                next(raw_stream(channel, hold=True))
        finally:
            for call in open_:
                call.cancel()
    ledger.record("load", "batch streams past max_streams",
                  detail="UNAVAILABLE naming the limit: the client asks another server")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "max_streams=2; ask another server" in err.value.details()


def test_watch_needs_the_token_and_check_does_not(start_server: StartServer, tmp_path,
                                                  ledger) -> None:
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123\n")
    server = start_server(TOY, server={"auth_token_file": str(token)})
    request = health_pb2.HealthCheckRequest(service="")
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Watch(request, timeout=10))
        watch = stub.Watch(request, timeout=10,
                           metadata=[("authorization", "Bearer 0123456789abcdef0123")])
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    ledger.record("security", "gRPC Health/Watch without the token",
                  detail="UNAUTHENTICATED; Check still answers without it (probes)")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


# -- also worth fixing: shared memory held by a frozen client -----------------------------------
NOISE = {"noise": {"format": "python", "factory": "toy_datasets:Noise",
                   "options": {"n": 120, "shape": [128, 128]}}}  # 64 KiB samples
NOISE_BS, CREDITS, FROZEN = 4, 30, 8  # 256 KiB batches


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_a_frozen_shared_memory_client_holds_at_most_its_cap(start_server: StartServer,
                                                             ledger) -> None:
    from stoker.client.transport.samehost import probe

    server = start_server(NOISE, server={"max_held_bytes_per_client": "2MiB",
                                         "max_credits": CREDITS},
                          cache={"shared_batches": 0})  # /dev/shm: what streams hold, alone
    pid = server.proc.pid
    answers: list[pb.BatchFrame] = []
    with grpc.insecure_channel(server.address) as channel:
        calls = [raw_stream(channel, tuple(range(CREDITS)), hold=True, shm_probe=probe(),
                            dataset="noise", batch_size=NOISE_BS) for _ in range(FROZEN)]
        try:
            for call in calls:  # every credit answered: lent (never released) or refused
                for _ in range(CREDITS):
                    answers.append(next(call))
            held = sum(p.stat().st_size for p in Path("/dev/shm").glob(f"stoker_{pid}_*"))
        finally:
            for call in calls:
                call.cancel()
    lent = [a for a in answers if a.shm_name]
    refused = [a.error for a in answers if a.HasField("error")]
    ledger.record("load", f"a frozen same-host client: {FROZEN} streams x {CREDITS} credits of "
                  "256 KiB batches, never released", tried=FROZEN * CREDITS,
                  detail=f"{len(lent)} lent (max_held_bytes_per_client=2MiB), the rest "
                         f"UNAVAILABLE in-band naming it; /dev/shm held {held >> 10} KiB")
    assert len(lent) + len(refused) == FROZEN * CREDITS
    assert lent and len(lent) == (2 << 20) // lent[0].payload_bytes
    assert all(e.code == grpc.StatusCode.UNAVAILABLE.value[0]
               and "max_held_bytes_per_client=2.0MiB" in e.message for e in refused), [
        e for e in refused if "max_held_bytes_per_client=2.0MiB" not in e.message][:2]
    # What the client holds, plus the one worker's own: KEEP_SEGMENTS free, DEPTH building.
    assert held <= (2 << 20) + (KEEP_SEGMENTS + DEPTH) * (512 << 10), held


# -- also worth fixing: epoch orders of many seeds ----------------------------------------------
SAMPLES = 4_000_000  # 32 MB per epoch order
SEEDS = 8


def test_many_seeds_on_a_large_dataset_keep_orders_under_their_cap(start_server: StartServer,
                                                                   tmp_path, ledger) -> None:
    data = tmp_path / "tokens"
    data.mkdir()
    with open(data / "big.bin", "wb") as f:  # sparse: reads as zeros, takes no disk
        f.truncate((SAMPLES + 1) * 2)
    server = start_server({"big": {"format": "tokens", "source": str(data), "seq_len": 1}},
                          server={"max_order_cache_bytes": "40MiB"})
    pid = server.proc.pid
    with grpc.insecure_channel(server.address) as channel:
        warm = raw_stream(channel, dataset="big", batch_size=4)
        next(warm)
        warm.cancel()
        baseline = status_kib(pid, "VmRSS")
        answered = 0
        for seed in range(1, SEEDS + 1):  # each stream half-closes: it ends once both are answered
            for frame in raw_stream(channel, (0, 1), dataset="big", batch_size=4, seed=seed):
                answered += not frame.offset and not frame.HasField("error")
    # The front end's peak resident memory (the kernel's high-water mark): orders live there.
    grew = (status_kib(pid, "VmHWM") - baseline) << 10
    order = SAMPLES * 8
    bound = (40 << 20) + 2 * order + (16 << 20)
    ledger.record("load", f"{SEEDS} seeds of a {SAMPLES:,}-sample dataset (32 MB per epoch "
                  "order)", tried=SEEDS,
                  detail=f"front end's peak resident memory +{grew >> 20} MiB "
                         f"(max_order_cache_bytes=40MiB; bound +{bound >> 20} MiB; before: "
                         f"+{SEEDS * order >> 20} MiB)")
    assert answered == 2 * SEEDS
    assert grew < bound, (grew, bound)


# -- also worth fixing: silent connections to the data port ------------------------------------
def test_silent_data_port_connections_do_not_delay_a_data_socket_stream(
        start_server: StartServer, ledger) -> None:
    server = start_server(TOY)
    with flood(server.ready["data_port"]):
        started = time.monotonic()
        got = toy(server.address, data_socket=True, shared_memory=False)
        took = time.monotonic() - started
    record_flood(ledger, "security", f"{FLOOD} silent connections to the data port from one "
                 "address, then a data-socket stream from another", got,
                 f"the epoch took {took:.1f} s, over the data socket")
    assert took < 4.0  # it waited SOCKET_WAIT (5 s) for its connection
    assert "did not connect within" not in server.stderr


# -- also worth fixing: coordinates and names ---------------------------------------------------
def test_world_size_larger_than_the_dataset_is_refused(start_server: StartServer,
                                                       ledger) -> None:
    server = start_server({**TOY, "a/b": TOY["toy"]})
    with pytest.raises(RemoteError) as err:
        with RemoteLoader(server.address, "toy", batch_size=1, world_size=64, rank=3,
                          timeout=20) as ld:
            len(ld)
    ledger.record("bad requests", "world_size larger than the dataset",
                  detail="INVALID_ARGUMENT naming world_size (it gave 0 batches silently)")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "world_size: 64 ranks but dataset 'toy' has 40 samples" in str(err.value)


def test_a_dataset_name_with_a_slash_is_served_over_http(start_server: StartServer,
                                                        ledger) -> None:
    server = start_server({**TOY, "a/b": TOY["toy"]})
    for path in ("a%2Fb", "a/b"):
        with urllib.request.urlopen(f"{server.http_url}/v1/datasets/{path}", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["name"] == "a/b"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{server.http_url}/v1/datasets/a/c", timeout=10)
    missing.value.close()
    ledger.record("http", "GET /v1/datasets/{name} for a name with a slash", tried=2,
                  detail="200 for a/b and a%2Fb; 404 for a/c")
    assert missing.value.code == 404


def test_grpc_connections_are_capped_per_client_address(start_server: StartServer,
                                                        ledger) -> None:
    """One address's calls on a third connection are refused (max_grpc_connections_per_client
    =2), more calls on a connection it has are not, and another address is served meanwhile:
    the server listens on both stacks, so 127.0.0.1 and ::1 are two clients."""
    server = start_server(TOY, host="::", server={"max_grpc_connections_per_client": 2})
    port = server.ready["grpc_port"]
    # A channel of its own per connection: channels with the same target and options would
    # share one.
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}",
                                      options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(3)]
    calls = []
    try:
        for channel in channels[:2]:
            calls.append(raw_stream(channel, hold=True))
            next(calls[-1])
        calls.append(raw_stream(channels[0], hold=True))  # a second call on a connection
        next(calls[-1])
        with pytest.raises(grpc.RpcError) as refused:
            next(raw_stream(channels[2], hold=True))
        got = toy(f"[::1]:{port}")  # another client, served as usual
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
    ledger.record("load", "gRPC connections from one client address past its cap",
                  tried=3, detail="calls on a third connection RESOURCE_EXHAUSTED naming "
                  "max_grpc_connections_per_client=2; more calls on the first two, and another "
                  "address's epoch, served")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_grpc_connections_per_client=2" in refused.value.details()
    assert got == list(range(40))
