"""The data port held against strangers (issue 41): silent connections from one address
cost a trainer on that address neither its data connection nor its throughput.

The server keeps at most MAX_CLAIMS_PER_HOST connections per address waiting to claim and
closes the oldest past it; a real client claims within milliseconds of connecting, so it is
never the oldest. Each epoch here is a new loader (new streams, new data connections), and
before each the stranger tops its silent connections back up to 300 (and the server has
closed all but the newest MAX_CLAIMS_PER_HOST of them: the epoch starts with that many
claims waiting from its own address). Epoch times are compared with quiet epochs run in
between, on the same machine.
"""

from __future__ import annotations

import socket
import statistics
import time
import urllib.request

import pytest

from stoker.client import RemoteLoader
from stoker.server.front.data_listener import CLAIM_WAIT, MAX_CLAIMS_PER_HOST

pytestmark = [pytest.mark.timeout(300), pytest.mark.serial]

SILENT = 300
EPOCHS = 20
NOISE = {"noise": {"format": "python", "factory": "toy_datasets:Noise",
                   "options": {"n": 120, "shape": [384, 256]}}}  # 384 KiB a sample, 45 MiB


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module(NOISE, workers=2)


def one_epoch(server) -> tuple[float, str]:
    t0 = time.perf_counter()
    with RemoteLoader(server.address, "noise", batch_size=8, output="numpy", timeout=60,
                      shared_memory=False, data_socket=True, prefetch=4) as loader:
        n = sum(len(b["sample_index"]) for b in loader)
        transport = loader.stats()["transport"]
    assert n == 120
    return time.perf_counter() - t0, transport


def metric(server, name: str) -> float:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    return next((float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith(name + " ")), 0.0)


def dropped(server) -> float:
    return metric(server, 'stoker_data_claims_dropped_total{reason="per_address"}')


def waiting(server) -> float:
    return metric(server, "stoker_data_claims_waiting")


def top_up(port: int, silent: list[socket.socket]) -> int:
    """Back to SILENT open connections that never send a byte (closed ones replaced); how
    many were opened."""
    alive = []
    for sock in silent:
        try:
            sock.setblocking(False)
            closed = sock.recv(1) == b""
        except BlockingIOError:
            closed = False
        except OSError:
            closed = True
        if closed:
            sock.close()
        else:
            alive.append(sock)
    silent[:] = alive
    opened = SILENT - len(silent)
    while len(silent) < SILENT:
        silent.append(socket.create_connection(("127.0.0.1", port), timeout=10))
    return opened


def settled(server, before: float, opened: int) -> None:
    """Until the server has accepted the new silent connections and closed all but the
    newest MAX_CLAIMS_PER_HOST (the epoch then starts with that many claims waiting from
    its own address, the case to hold against)."""
    deadline = time.monotonic() + 10
    while dropped(server) < before + opened - MAX_CLAIMS_PER_HOST:
        assert time.monotonic() < deadline, "the server did not close the silent connections"
        time.sleep(0.05)


def test_silent_connections_from_one_address_keep_no_trainer_off_its_data_connection(
        server, ledger) -> None:
    port = server.ready["data_port"]
    one_epoch(server)  # warm: workers, imports
    quiet = [one_epoch(server) for _ in range(5)]
    assert all(t == "data_socket" for _, t in quiet)
    silent: list[socket.socket] = []
    disturbed = []
    try:
        for _ in range(EPOCHS):
            before = dropped(server)
            settled(server, before, top_up(port, silent))
            disturbed.append(one_epoch(server))
            # Quiet epochs between, on the same (noisy, shared) machine: the ratio compares
            # like with like.
            quiet.append(one_epoch(server))
        fallen = [t for _, t in disturbed if t != "data_socket"]
        # The server closed all but the newest MAX_CLAIMS_PER_HOST at once, and those within
        # CLAIM_WAIT: none is left waiting long after.
        time.sleep(CLAIM_WAIT + 1)  # waiting out the documented bound itself
        top_up(port, silent)
        left = len(silent)
    finally:
        for sock in silent:
            sock.close()
    closed = dropped(server)
    # Each disturbed epoch against the quiet one run right after it: pairs cancel the machine's
    # drift. The harms held against cost far more than the bound: a trainer's claim closed as a
    # stranger's waits SOCKET_WAIT (5 s, 100x a 50 ms epoch) or falls back to frames (above).
    # The bound (within 10%); the ratio of medians failed CI at 1.1005 on a busy machine.
    ratio = statistics.median(d / q for (d, _), (q, _) in zip(disturbed, quiet[5:], strict=True))
    ledger.record("security", f"data port: {SILENT} silent connections from the trainer's "
                  f"address before each of {EPOCHS} epochs", tried=EPOCHS,
                  detail=f"{len(fallen)} epochs fell back to frames; epoch time "
                         f"{ratio:.2f}x undisturbed; {closed:.0f} closed per address")
    assert not fallen, fallen
    assert left == SILENT  # the top-up itself works (the server kept accepting)
    assert closed >= EPOCHS * (SILENT - MAX_CLAIMS_PER_HOST)
    assert metric(server, 'stoker_data_claims_limit{scope="per_address"}') == (
        MAX_CLAIMS_PER_HOST)
    assert ratio <= 1.10, (ratio, disturbed, quiet)


def test_a_saturated_data_port_is_not_offered_and_streams_get_frames_at_once(
        server, ledger) -> None:
    """MAX_CLAIMS silent connections from many addresses (127.0.0.2...: loopback answers
    every 127/8 address): a new stream is offered no data connection while they wait, so it
    is served in frames at once instead of waiting SOCKET_WAIT for an offer a stranger's
    connection may evict; once they are closed (CLAIM_WAIT), the data connection is back."""
    from stoker.server.front.data_listener import MAX_CLAIMS
    from stoker.server.front.transports.datasocket import SOCKET_WAIT

    port = server.ready["data_port"]
    silent = []
    try:
        for i in range(MAX_CLAIMS):
            host = f"127.0.0.{2 + i // MAX_CLAIMS_PER_HOST}"
            silent.append(socket.create_connection(("127.0.0.1", port), timeout=10,
                                                   source_address=(host, 0)))
        deadline = time.monotonic() + 10
        while waiting(server) < MAX_CLAIMS:  # all accepted, none evicted: saturated
            assert time.monotonic() < deadline
            time.sleep(0.05)
        took, transport = one_epoch(server)
    finally:
        for sock in silent:
            sock.close()
    assert transport == "frames"
    assert took < SOCKET_WAIT, took
    time.sleep(CLAIM_WAIT + 0.5)  # the documented bound: their claims' places are free
    assert one_epoch(server)[1] == "data_socket"
    ledger.record("security", f"data port: {MAX_CLAIMS} silent connections from "
                  f"{MAX_CLAIMS // MAX_CLAIMS_PER_HOST} addresses", tried=1,
                  detail=f"no offer while saturated: frames at once ({took:.2f} s an epoch, "
                         f"not {SOCKET_WAIT:g} s); the data connection back after them")
