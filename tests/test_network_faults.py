"""A broken network between RemoteLoader and its servers (tests/tcp_proxy.py in the path).

Faults land mid-epoch on one of two servers or on the only one. A temporary fault costs
nothing: the sequence equals the failure-free one element for element. A permanent one is an
error naming the address within the client's retry window (`timeout`, set small here).

Payloads go through the proxy: shared_memory=False (on one host the client would otherwise
read batches from /dev/shm, beside the path under test). The data connection (the default)
would bypass a proxy in front of gRPC alone: the client learns only its *port* from the
stream's first frame and dials the host it reached gRPC on at that port. So the data socket
tests put both proxies on 127.0.0.2, the data one at the server's own data port (free there:
the server listens on 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from epochs import epoch

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess

from conftest import StartServer
from tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(60)

N, BS, SEED = 40, 2, 11
DATASETS = {"toy": {"format": "python", "factory": "toy_datasets:toy",
                    "options": {"n": N, "delay": 0.01}}}
# data_socket=False: these faults are on gRPC frames through `proxies`; the default path (the
# data connection, dialled past a proxy in front of gRPC alone) is under `data_proxies`.
KW: dict[str, Any] = dict(batch_size=BS, seed=SEED, shuffle=True, order="legacy",
                          output="numpy", prefetch=4,
                          timeout=20, shared_memory=False, data_socket=False)
HEAL_AFTER = 0.6  # seconds a temporary fault lasts
REFERENCE = np.random.default_rng([SEED, 0]).permutation(N).tolist()


@pytest.fixture(scope="module")
def two(start_server_module: StartServer) -> list[ServerProcess]:
    return [start_server_module(DATASETS, server={"grace_seconds": 1}) for _ in range(2)]


@pytest.fixture
def proxies(two: list[ServerProcess]) -> Iterator[list[TcpProxy]]:
    made = [TcpProxy(s.address).start() for s in two]
    yield made
    for p in made:
        p.close()


def heal_later(proxy: TcpProxy, after: float = HEAL_AFTER) -> threading.Thread:
    """Set the proxy back to "pass" `after` seconds from now, on a thread."""
    stop = threading.Event()
    t = threading.Thread(target=lambda: stop.wait(after) or proxy.set("pass"), daemon=True)
    t.start()
    return t


def faulted(addresses: list[str], at: int, fault: Callable[[], Any], **kw: Any
            ) -> tuple[list[int], dict[str, Any]]:
    """An epoch of `toy` with `fault()` after batch `at`: (the sample indices, the stats)."""
    def after(k: int) -> None:
        if k == at:
            fault()

    read = epoch(addresses, "toy", on_batch=after, **{**KW, **kw})
    return read.indices(), read.stats


FAULTS = {"drop": dict(), "stall": dict(), "truncate": dict(limit=1500),
          "delay": dict(seconds=0.05)}


@pytest.mark.parametrize(("mode", "where"), [
    *[(mode, "one of 2") for mode in ("drop", "stall", "truncate")],
    *[(mode, "the only server") for mode in FAULTS]])
def test_a_temporary_fault_loses_and_repeats_nothing(proxies, ledger, mode: str,
                                                     where: str) -> None:
    victim = proxies[0]
    targets = [p.address for p in proxies] if where == "one of 2" else [victim.address]
    healer: list[threading.Thread] = []

    def fault() -> None:
        victim.set(mode, **FAULTS[mode])
        healer.append(heal_later(victim))

    started = time.monotonic()
    got, stats = faulted(targets, at=3, fault=fault)
    healer[0].join(10)
    lost, dup = ledger.compare(got, REFERENCE)
    ledger.record("network", f"{mode} for {HEAL_AFTER:g} s, mid-epoch, on {where}", lost=lost,
                  duplicated=dup, detail=f"recovered; epoch in {time.monotonic() - started:.1f}"
                  f" s, {stats['failovers']} failovers, {stats['hedges']} hedges")
    assert lost == dup == 0
    assert got == REFERENCE
    if mode == "drop":
        assert victim.refused > 0 or victim.accepted > 1  # the client did reconnect


@pytest.mark.parametrize("mode", ["drop", "stall", "truncate"])
def test_a_permanent_fault_on_one_of_two_is_carried_by_the_other(proxies, ledger,
                                                                 mode: str) -> None:
    victim = proxies[0]
    got, stats = faulted([p.address for p in proxies], at=3,
                       fault=lambda: victim.set(mode, **FAULTS[mode]))
    lost, dup = ledger.compare(got, REFERENCE)
    ledger.record("network", f"{mode} for good, mid-epoch, on one of 2", lost=lost,
                  duplicated=dup, detail=f"the other server finished the epoch; server state "
                  f"{stats['servers'][victim.address]['state']}")
    assert lost == dup == 0 and got == REFERENCE
    assert stats["servers"][proxies[1].address]["batches"] > 0


@pytest.mark.parametrize("mode", ["drop", "stall", "truncate"])
def test_a_permanent_fault_on_the_only_server_is_an_error_naming_it(proxies, ledger,
                                                                    mode: str) -> None:
    victim = proxies[0]
    window = 2.0
    got: list[int] = []
    with RemoteLoader(victim.address, "toy", **{**KW, "timeout": window}) as loader:
        it = iter(loader)
        got += next(it)["sample_index"].tolist()
        # truncate: 20 bytes a connection is less than the server's HTTP/2 settings frame.
        victim.set(mode, **{**FAULTS[mode], "limit": 20} if mode == "truncate" else {})
        started = time.monotonic()
        with pytest.raises(RemoteError) as info:
            for batch in it:
                got += batch["sample_index"].tolist()
    took = time.monotonic() - started
    # What arrived is a prefix of the failure-free epoch: nothing out of order, nothing twice.
    lost, dup = ledger.compare(got, REFERENCE[: len(got)])
    ledger.record("network", f"{mode} for good, mid-epoch, on the only server", lost=lost,
                  duplicated=dup, detail=f"clear error after {took:.1f} s (timeout "
                  f"{window:g} s): {info.value.code.name} naming the address")
    assert lost == dup == 0
    assert victim.address in str(info.value)
    assert took < window + 10


def test_connections_cut_short_for_good_still_make_progress(proxies, ledger) -> None:
    """Every connection, old and new, carries 1500 bytes each way and is then closed: each
    reconnection delivers a batch or two, and the epoch completes, exactly."""
    victim = proxies[0]
    got, _ = faulted([victim.address], at=2, fault=lambda: victim.set("truncate", limit=1500))
    lost, dup = ledger.compare(got, REFERENCE)
    ledger.record("network", "every connection cut after 1500 bytes, for good, on the only "
                  "server", lost=lost, duplicated=dup,
                  detail=f"completed through {victim.truncated} cut connections")
    assert lost == dup == 0 and got == REFERENCE
    assert victim.truncated > 1


def test_a_data_socket_stream_survives_a_dropped_control_path(proxies, ledger) -> None:
    victim = proxies[0]
    heal: list[threading.Thread] = []

    def fault() -> None:
        victim.set("drop")
        heal.append(heal_later(victim))

    got, _ = faulted([p.address for p in proxies], at=3, fault=fault, data_socket=True)
    heal[0].join(10)
    lost, dup = ledger.compare(got, REFERENCE)
    ledger.record("network", "drop the gRPC path of a data-socket stream, on one of 2",
                  lost=lost, duplicated=dup,
                  detail="recovered (the data socket itself bypasses the proxy)")
    assert lost == dup == 0 and got == REFERENCE


def test_the_proxy_passes_and_breaks_plain_tcp() -> None:
    """The proxy itself: pass, truncate, drop (refuse), on a tiny echo server."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        def echo() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                with conn:
                    while data := conn.recv(1 << 16):
                        conn.sendall(data)

        t = threading.Thread(target=echo, daemon=True)
        t.start()
        with TcpProxy(server.getsockname()).start() as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as c:
                c.sendall(b"hello")
                assert c.recv(5) == b"hello"
            proxy.set("truncate", limit=4)
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as c:
                c.sendall(b"ab")  # within the limit each way: echoed
                assert c.recv(2) == b"ab"
                c.sendall(b"cdef")  # past it: "cd" goes on, then the connection is closed
                with contextlib.suppress(ConnectionResetError):
                    while c.recv(16):
                        pass
                assert proxy.truncated == 1
            proxy.set("drop")
            with pytest.raises(OSError):  # the reset may even beat connect() back
                with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as c:
                    c.sendall(b"x")
                    if not c.recv(1):
                        raise ConnectionResetError("closed")
            assert proxy.refused == 1
        server.shutdown(socket.SHUT_RDWR)  # wakes accept()
        t.join(5)
        assert not t.is_alive()


def stream_count(server: ServerProcess) -> int:
    with urllib.request.urlopen(server.http_url + "/v1/stats", timeout=10) as r:
        return sum(d["streams"] for d in json.load(r)["datasets"].values())


def wait_for_no_streams(servers: list[ServerProcess], timeout: float = 20.0) -> None:
    """Bounded poll of the servers' /v1/stats until no stream is open."""
    deadline = time.monotonic() + timeout
    while any(stream_count(s) for s in servers):
        if time.monotonic() > deadline:
            raise AssertionError(f"streams left open: {[stream_count(s) for s in servers]}")
        threading.Event().wait(0.05)


@pytest.fixture
def data_proxies(two: list[ServerProcess]) -> Iterator[list[tuple[TcpProxy, TcpProxy]]]:
    """(gRPC proxy, data socket proxy) per server, both on 127.0.0.2. The client dials the
    data port on the host it reached gRPC on, so 127.0.0.2:<the server's data port> (free:
    the server listens on 127.0.0.1) puts the data socket behind a proxy too."""
    made = []
    for s in two:
        grpc_proxy = TcpProxy(s.address, host="127.0.0.2").start()
        data_port = s.ready["data_port"]
        data_proxy = TcpProxy(("127.0.0.1", data_port), host="127.0.0.2",
                              port=data_port).start()
        made.append((grpc_proxy, data_proxy))
    yield made
    for pair in made:
        for p in pair:
            p.close()


# (A data port refused outright is not here: the client falls back to frames within 0.5 s;
# test_wire.py covers that.)
@pytest.mark.parametrize(("mode", "kw"), [("truncate", {"limit": 300}), ("stall", {})])
@pytest.mark.parametrize("where", ["one of 2", "the only server"])
def test_a_broken_data_socket_loses_and_repeats_nothing(two, data_proxies, ledger, mode: str,
                                                        kw: dict[str, Any],
                                                        where: str) -> None:
    victim = data_proxies[0][1]
    n = 2 if where == "one of 2" else 1
    heal: list[threading.Thread] = []

    def fault() -> None:
        victim.set(mode, **kw)
        heal.append(heal_later(victim))

    got, stats = faulted([g.address for g, _ in data_proxies[:n]], at=3, fault=fault,
                       data_socket=True)
    heal[0].join(10)
    wait_for_no_streams(two)  # and the servers let go of every stream the client dropped
    lost, dup = ledger.compare(got, REFERENCE)
    ledger.record("network", f"{mode} the data socket for {HEAL_AFTER:g} s, mid-epoch, on "
                  f"{where}", lost=lost, duplicated=dup,
                  detail=f"recovered; {stats['failovers']} failovers; no stream left open")
    assert lost == dup == 0 and got == REFERENCE
    assert victim.forwarded[1] > 0 or victim.truncated  # payloads did cross this proxy


def test_a_stream_cut_on_its_data_socket_is_ended_at_the_server_at_once(two, data_proxies,
                                                                       ledger) -> None:
    """One credit at a time, so a cut lands on the stream's last answered batch: the server
    has nothing more to send and would not notice the broken socket. The client ends the
    call itself (it used to leave it open until the loader closed: one server stream, and
    one client thread, per cut)."""
    grpc_proxy, data_proxy = data_proxies[0]
    got: list[int] = []
    with RemoteLoader(grpc_proxy.address, "toy", **{**KW, "prefetch": 1, "data_socket": True,
                                                    "prefetch_next_epoch": False}) as loader:
        for k, batch in enumerate(loader):
            got += batch["sample_index"].tolist()
            if k == 3:
                data_proxy.set("truncate", limit=300)
                heal_later(data_proxy)
        cuts = data_proxy.truncated
        wait_for_no_streams(two[:1], timeout=10)  # with the loader still open
    lost, dup = ledger.compare(got, REFERENCE)
    ledger.record("network", "data socket cut mid-payload, one credit at a time, the only "
                  "server", lost=lost, duplicated=dup,
                  detail=f"{cuts} cut streams, each ended at the server while the loader "
                         "lived")
    assert lost == dup == 0 and got == REFERENCE
    assert cuts > 0
