"""Faults between machines (tests/hosts.py: servers, or a client, on other hosts behind veth
links): a host that loses its network (every packet dropped: no FIN, no RST), for good or
until the partition heals, and an address that black-holes from the start.

- A black-holed address among several costs the first batch no more than CHECK_WAIT
  (client/contact/agreement.py): first contact asks every server at once and a server gets no
  credits before it answered; one with other data that answers late is refused when it answers.
- A host silenced mid-epoch: its batches are asked of the other (the awaited one after
  HEDGE_MIN, the rest after STALL_MIN): nothing lost, nothing twice, the longest wait between
  batches bounded; healed, it is used again within the client's re-probe of a failed server
  (docs/deployment.md).
- A client whose host goes silent is let go by the server within silent_client_seconds: its
  stream ends, its credits and the shared memory it held are freed.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from stoker.client import DataMismatch, RemoteLoader
from stoker.client.fleet.servers import BACKOFF_MAX, PROBE_EVERY

from conftest import StartServer
from hosts import Host, hosts_or_skip

# serial: timing figures (waits, shares of a rate) that a second test process beside them would
# bend; `make test` runs them alone, after the rest in parallel.
pytestmark = [pytest.mark.timeout(60), pytest.mark.serial]

N, BS = 600, 4
TOY = {"toy": {"format": "python", "factory": "toy_datasets:toy",
               "options": {"n": N, "delay": 0.002}}}
KW: dict[str, Any] = dict(batch_size=BS, shuffle=False, output="numpy", prefetch=8,
                          timeout=30, prefetch_next_epoch=False)
FIRST_BATCH_EXTRA = 1.5  # seconds a black-holed address may add to the first batch
LONGEST_WAIT = 1.5  # seconds between batches while a host goes silent
HEAL_AFTER = 5.0  # seconds a partition lasts
# How soon a healed server must deliver again: a stalled server gets a probe credit every
# PROBE_EVERY s; where its connection ended meanwhile, the retry of a down server and the
# channel's reconnection come at most BACKOFF_MAX s apart each (client/fleet/servers.py,
# docs/deployment.md#timeouts-for-the-network). A second for a busy machine.
REPROBE = PROBE_EVERY + BACKOFF_MAX + 1.0


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    hosts_or_skip()
    with Host(1) as a, Host(2) as b:
        yield a, b


def first_batch_seconds(addresses: list[str]) -> float:
    """Seconds from a new loader to its first batch."""
    began = time.monotonic()
    with RemoteLoader(addresses, "toy", **KW) as loader:
        next(iter(loader))
        return time.monotonic() - began


def test_a_black_holed_first_address_costs_the_first_batch_little(
        two_hosts: tuple[Host, Host], start_server: StartServer, ledger) -> None:
    dead, live = two_hosts
    a = start_server(TOY, wrap=dead.wrap, host=dead.ip)
    b = start_server(TOY, wrap=live.wrap, host=live.ip)
    first_batch_seconds([b.address])  # warm: the server's first epoch order, its imports
    dead.silence()
    # Medians of 3 each way, interleaved: the machine is shared and busy.
    without, with_dead = [], []
    for _ in range(3):
        without.append(first_batch_seconds([b.address]))
        with_dead.append(first_batch_seconds([a.address, b.address]))
    without.sort()
    with_dead.sort()
    extra = with_dead[1] - without[1]
    dead.heal()
    ledger.record("network", "the first of two addresses black-holed (host silent) before the "
                  "loader starts", detail=f"first batch in {with_dead[1]:.2f} s against "
                  f"{without[1]:.2f} s without that address (+{extra:.2f} s, median of 3)")
    assert extra <= FIRST_BATCH_EXTRA, (with_dead, without)


def test_a_server_with_other_data_that_answers_late_is_refused_when_it_answers(
        two_hosts: tuple[Host, Host], start_server: StartServer, ledger) -> None:
    """Fingerprints are compared as the servers answer: one whose host is cut off when the
    loader starts, and back 1.5 s later, answers after the first batches were used (TCP
    resends the connect 1 s, then 3 s after the first); it got no credits meanwhile, and its
    answer stops the loader with the DataMismatch naming both."""
    def versioned(version: int) -> dict[str, Any]:
        return {"v": {"format": "python", "factory": "drift_datasets:Versioned",
                      "options": {"n": 4000, "version": version, "delay": 0.002}}}

    near, far = two_hosts
    pinned = start_server(versioned(1), wrap=near.wrap, host=near.ip)
    other = start_server(versioned(2), wrap=far.wrap, host=far.ip)
    far.silence()
    heal = threading.Timer(1.5, far.heal)
    versions: list[int] = []
    began = time.monotonic()
    heal.start()
    with pytest.raises(DataMismatch) as info:
        with RemoteLoader([pinned.address, other.address], "v", **KW) as loader:
            for batch in loader:
                versions += batch["version"].tolist()
    took = time.monotonic() - began
    heal.join(10)
    said = str(info.value)
    ledger.record("servers", "a server with other data, its host cut off for 1.5 s as the "
                  "loader starts, answers after the first batches",
                  detail=f"DataMismatch naming both after {took:.1f} s and {len(versions)} "
                  "samples, all from the pinned server")
    assert pinned.address in said and other.address in said and "must not mix" in said, said
    assert versions and set(versions) == {1}


def test_an_address_that_accepts_and_never_speaks_costs_the_first_batch_little(
        start_server: StartServer) -> None:
    """The same on one host, where namespaces cannot be made: a port whose listener never
    accepts (the kernel completes TCP connects; nothing answers gRPC's preface) first."""
    server = start_server(TOY)
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:
        mute = f"127.0.0.1:{silent.getsockname()[1]}"
        first_batch_seconds([server.address])  # warm
        without = sorted(first_batch_seconds([server.address]) for _ in range(3))
        with_mute = sorted(first_batch_seconds([mute, server.address]) for _ in range(3))
    assert with_mute[1] - without[1] <= FIRST_BATCH_EXTRA, (with_mute, without)


class Watch:
    """Iterates a loader epoch after epoch, noting every sample, the longest wait between
    batches and when each server last delivered; `at(k, fault)` runs fault() after the k-th
    batch of the run."""

    def __init__(self, loader: RemoteLoader) -> None:
        self.loader = loader
        self.epochs: list[list[int]] = []
        self.longest = 0.0
        self.delivered: dict[str, tuple[int, float]] = {}  # address -> (batches, when)

    def run(self, faults: dict[int, Any] | None = None, until: Any = None) -> None:
        got: list[int] = []
        last = time.monotonic()
        for k, batch in enumerate(self.loader):
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            got += batch["sample_index"].tolist()
            for address, s in self.loader.stats()["servers"].items():
                if self.delivered.get(address, (0, 0.0))[0] != s["batches"]:
                    self.delivered[address] = (s["batches"], now)
            if faults and k in faults:
                faults.pop(k)()
            last = time.monotonic()
        self.epochs.append(got)


def test_a_host_silenced_mid_epoch_for_good(two_hosts: tuple[Host, Host],
                                            start_server: StartServer, ledger) -> None:
    dead = two_hosts[0]
    servers = [start_server(TOY, wrap=h.wrap, host=h.ip) for h in two_hosts]
    with RemoteLoader([s.address for s in servers], "toy", **KW) as loader:
        watch = Watch(loader)
        watch.run({20: dead.silence})
        watch.run()
        stats = loader.stats()
    lost = dup = 0
    for got in watch.epochs:
        lo, du = ledger.compare(got, range(N))
        lost, dup = lost + lo, dup + du
    ledger.record("network", "one of 2 servers' host silenced (every packet dropped) mid-epoch, "
                  "for good", lost=lost, duplicated=dup,
                  detail=f"longest wait between batches {watch.longest:.2f} s; the next epoch "
                  f"from the other; {stats['failovers']} failovers, {stats['hedges']} hedges")
    dead.heal()
    assert lost == dup == 0
    assert all(got == list(range(N)) for got in watch.epochs)
    assert watch.longest <= LONGEST_WAIT, watch.longest


def test_a_partition_that_heals_is_used_again(two_hosts: tuple[Host, Host],
                                              start_server: StartServer, ledger) -> None:
    parted = two_hosts[0]
    servers = [start_server(TOY, wrap=h.wrap, host=h.ip) for h in two_hosts]
    healed = threading.Event()
    healed_at: list[float] = []

    def part() -> None:
        parted.silence()
        threading.Timer(HEAL_AFTER, lambda: (parted.heal(), healed_at.append(time.monotonic()),
                                             healed.set())).start()

    address = servers[0].address
    with RemoteLoader([s.address for s in servers], "toy", **KW) as loader:
        watch = Watch(loader)
        watch.run({20: part})
        deadline = time.monotonic() + HEAL_AFTER + REPROBE + 10
        # Epochs until the healed server has delivered again (bounded by time).
        while time.monotonic() < deadline and not (
                healed.is_set() and watch.delivered[address][1] > healed_at[0]):
            watch.run()
        stats = loader.stats()
    assert healed.wait(10)
    back = watch.delivered[address][1] - healed_at[0]
    lost = dup = 0
    for got in watch.epochs:
        lo, du = ledger.compare(got, range(N))
        lost, dup = lost + lo, dup + du
    ledger.record("network", f"one of 2 servers' host silenced mid-epoch, healed after "
                  f"{HEAL_AFTER:g} s", tried=len(watch.epochs), lost=lost, duplicated=dup,
                  detail=f"longest wait between batches {watch.longest:.2f} s; the healed server "
                  f"delivered again {back:.1f} s after the heal; {stats['failovers']} failovers")
    assert lost == dup == 0
    assert all(got == list(range(N)) for got in watch.epochs)
    assert watch.longest <= LONGEST_WAIT, watch.longest
    assert 0 < back <= REPROBE, back


CLIENT = """
import sys
from stoker.client import DataMismatch, RemoteLoader
from stoker.client.fleet.servers import BACKOFF_MAX, PROBE_EVERY
# data_socket=False: batches lent in shared memory (its network namespace shares this
# host's /dev/shm), which the server holds for it until it lets the silent client go.
loader = RemoteLoader(sys.argv[1], "toy", batch_size=4, output="numpy", prefetch=8,
                      timeout=600, data_socket=False)
it = iter(loader)
for _ in range(3):
    next(it)
print("holding", flush=True)
sys.stdin.read()  # holds its stream, credits and lent batches until the test ends it
"""
SILENT_CLIENT = 6.0  # silent_client_seconds here (40 by default)


def server_stats(url: str) -> tuple[int, int]:
    """(open streams of "toy", shared memory the streams hold) from /v1/stats."""
    with urllib.request.urlopen(url + "/v1/stats", timeout=5) as r:
        s = json.load(r)
    return s["datasets"].get("toy", {}).get("streams", 0), s["stream_held_bytes"]


def test_a_silent_client_is_let_go_within_silent_client_seconds(
        start_server: StartServer, ledger) -> None:
    """The client on another host, the server on this one (at the link's near end): the
    client's host goes silent while the server builds what it credited (0.2 s a batch), so
    the server lends batches nobody will release."""
    hosts_or_skip()
    slow = {"toy": {**TOY["toy"], "options": {"n": N, "delay": 0.05}}}
    with Host(1) as client_host:
        server = start_server(slow, server={"silent_client_seconds": SILENT_CLIENT},
                              host=client_host.gateway)
        with subprocess.Popen([*client_host.wrap, sys.executable, "-c", CLIENT,
                               server.address], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) as client:
            try:
                assert client.stdout is not None
                assert client.stdout.readline().strip() == "holding"
                assert server_stats(server.http_url)[0] == 1
                client_host.silence()
                began = time.monotonic()
                held = 0
                while time.monotonic() - began < SILENT_CLIENT + 10:
                    streams, now_held = server_stats(server.http_url)
                    held = max(held, now_held)
                    if streams == 0 and now_held == 0:
                        break
                    time.sleep(0.05)  # a poll of the server's figures, bounded by the loop
                took = time.monotonic() - began
            finally:
                client.kill()
    ledger.record("clients", "a client's host goes silent mid-stream (every packet dropped)",
                  detail=f"the server let go of its stream and {held} bytes of lent shared "
                  f"memory after {took:.1f} s (silent_client_seconds={SILENT_CLIENT:g})")
    assert (streams, now_held) == (0, 0), (streams, now_held)
    assert held > 0  # it did hold something for the silent client
    assert took <= SILENT_CLIENT, took
