"""A dns:/// target re-resolved every `dns_refresh` seconds by a resolver the test controls:
servers join and leave mid-epoch, and the epoch loses and repeats nothing."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from stoker.client import RemoteLoader
from stoker.client.fleet.servers import RESOLVE_WAIT, ServerSet, ServerState
from stoker.server import ServerProcess, write_config

from conftest import server_env

pytestmark = pytest.mark.timeout(90)

N, B = 300, 2  # 150 batches, 10 ms a sample: ~3 s on one server, time for the changes
DATASETS = {"toy": {"format": "python", "factory": "toy_datasets:toy",
                    "options": {"n": N, "delay": 0.01}}}
GRACE = 30  # a's drain takes less: the loop lets go of it
KW = dict(batch_size=B, seed=3, shuffle=True, order="legacy",
          output="numpy", prefetch=6, timeout=60)


class Names:
    """What the name resolves to now: the test's side of a resolver (thread-safe)."""

    def __init__(self, *addresses: str) -> None:
        self._lock = threading.Lock()
        self._now = list(addresses)
        self.asked = 0

    def set(self, *addresses: str) -> None:
        with self._lock:
            self._now = list(addresses)

    def __call__(self, target: str) -> list[str]:
        assert target == "dns:///trainers-data:50051"
        with self._lock:
            self.asked += 1
            return list(self._now)


def test_servers_joining_and_draining_mid_epoch_are_found_and_dropped(tmp_path: Path,
                                                                      ledger) -> None:
    config = write_config(tmp_path / "c.yaml", {"server": {"grace_seconds": GRACE},
                                                "datasets": DATASETS})
    a, b = (ServerProcess(config, workers=1, env=server_env()).start() for _ in range(2))
    try:
        names = Names(a.address)
        got: list[int] = []
        drained = False
        exited: float | None = None  # seconds from a's SIGTERM to its exit, seen mid-epoch
        with RemoteLoader("dns:///trainers-data:50051", "toy", dns_refresh=0.05,
                          resolver=names, **KW) as loader:
            for k, batch in enumerate(loader):
                got += batch["sample_index"].tolist()
                used = {addr: s["batches"] for addr, s in loader.stats()["servers"].items()}
                if k == 3:
                    names.set(a.address, b.address)  # b joins
                elif not drained and used.get(b.address, 0) > 0:
                    names.set(b.address)  # a leaves: off the name, and drained
                    a.proc.send_signal(signal.SIGTERM)
                    sent = time.monotonic()
                    drained = True
                    at_drain = used[a.address]
                if drained and a.proc.poll() is not None and exited is None:
                    exited = time.monotonic() - sent
            stats = loader.stats()["servers"]
        want = np.random.default_rng([KW["seed"], 0]).permutation(N).tolist()
        lost, dup = ledger.compare(got, want)
        ledger.record("servers", "dns name: a server joins mid-epoch, another leaves "
                      "(drained)", lost=lost, duplicated=dup,
                      detail=f"resolver asked {names.asked} times")
        assert drained, f"the joining server never delivered a batch: {stats}"
        assert got == want
        # The loop let go of a once it held nothing: a's drain ended mid-epoch, without
        # waiting out its grace for our stream.
        assert exited is not None, f"a still runs {time.monotonic() - sent:.1f} s after SIGTERM"
        assert stats[a.address]["state"] == "gone"
        assert stats[a.address]["batches"] <= at_drain + KW["prefetch"]  # held ones only
        assert stats[b.address]["batches"] >= N // B - stats[a.address]["batches"]
        assert names.asked >= 3
    finally:
        for p in (a, b):
            assert p.stop() == 0, p.stderr


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(dns_refresh=0), "dns_refresh must be > 0"),
    (dict(dns_refresh="5"), "dns_refresh must be > 0"),
    (dict(resolver=lambda t: ["x:1"], address="127.0.0.1:1"), "resolver applies to a 'dns:"),
    (dict(resolver="hosts.txt"), "resolver must be a callable"),
    (dict(resolver=lambda t: "a:1"), "resolver returned 'a:1'"),
    (dict(resolver=lambda t: ["a"]), r"resolver returned \['a'\]"),
    (dict(resolver=lambda t: ["dns:///a:1"]), "resolver returned"),
])
def test_bad_dns_options_are_clear_errors(kwargs, match: str) -> None:
    address = kwargs.pop("address", "dns:///data:50051")
    with pytest.raises(ValueError, match=match):
        RemoteLoader(address, "toy", batch_size=2, **kwargs)


def test_a_resolver_that_cannot_tell_keeps_the_servers_known(toy_server) -> None:
    answers = iter([[toy_server.address]])

    def flaky(target: str) -> list[str]:
        try:
            return next(answers)
        except StopIteration:
            raise OSError("registry unreachable") from None

    with RemoteLoader("dns:///data:1", "toy", batch_size=10, shuffle=False, output="numpy",
                      dns_refresh=0.01, resolver=flaky) as loader:
        got = [i for batch in loader for i in batch["sample_index"].tolist()]
        assert loader.stats()["servers"][toy_server.address]["state"] == "up"
    assert got == list(range(100))


def test_a_server_off_its_name_stays_gone_whatever_its_stream_does() -> None:
    """Taken off the name, then drained or cut: not retried until the name lists it again
    (a drained server that was retried would hold credits while it refuses connections)."""
    names = Names("127.0.0.1:1")
    servers = ServerSet("dns:///trainers-data:50051", dns_refresh=1, resolver=names)
    try:
        (server,) = servers.servers.values()
        names.set()
        servers.refresh(time.monotonic() + 2)
        for change in (lambda: server.mark_draining("draining"),
                       lambda: server.mark_drained(0.0), lambda: server.mark_down("cut", 0.0)):
            change()
            assert server.state is ServerState.GONE and not server.usable(1e9)
        names.set("127.0.0.1:1")
        servers.refresh(time.monotonic() + 4)
        assert server.state is ServerState.UP
    finally:
        servers.close()


def test_a_look_up_that_hangs_does_not_hold_up_the_loop() -> None:
    """A DNS server that answers late (or never: the system resolver tries for 5 s a time)
    must not stall the training loop each dns_refresh: the refresh waits RESOLVE_WAIT at
    most, and the answer is used by the first refresh after it comes."""
    names, gate, started = Names("127.0.0.1:1"), threading.Event(), []

    def late(target: str) -> list[str]:
        started.append(time.monotonic())
        if names.asked:  # the first look-up answers at once, every later one hangs
            assert gate.wait(30), "the test never let the look-up answer"
        return names(target)

    servers = ServerSet("dns:///trainers-data:50051", dns_refresh=1, resolver=late)
    try:
        names.set("127.0.0.1:2")
        t0 = time.monotonic()
        for k in range(20):  # twenty turns of the loop while the look-up hangs
            servers.refresh(1000.0 + k)
        # The refresh that started the look-up waited RESOLVE_WAIT; the others only looked.
        assert time.monotonic() - t0 < RESOLVE_WAIT + 0.45
        assert list(servers.servers) == ["127.0.0.1:1"]
        assert len(started) == 2  # the first, and one that hangs: one look-up at a time
        gate.set()
        deadline = time.monotonic() + 10
        while "127.0.0.1:2" not in servers.servers and time.monotonic() < deadline:
            servers.refresh(1000.0 + 20)  # within the period: no new look-up, the answer
        assert servers.servers["127.0.0.1:2"].state is ServerState.UP
        assert servers.servers["127.0.0.1:1"].state is ServerState.GONE
        assert names.asked == len(started) == 2
    finally:
        gate.set()
        servers.close()
