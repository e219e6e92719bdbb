"""Several servers, and servers that fail: the sequence a trainer sees never changes.

Every test compares the sample_index sequence element for element with a failure-free run.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

from conftest import server_env

# Slow enough (10 ms a sample) that faults land mid-epoch; 30 batches of 2.
DATASETS = {"toy": {"format": "python", "factory": "toy_datasets:toy",
                    "options": {"n": 60, "delay": 0.01}}}
KW = dict(batch_size=2, seed=7, shuffle=True, order="legacy",
          output="numpy", prefetch=6, timeout=60)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[ServerProcess]]:
    config = write_config(tmp_path / "config.yaml",
                          {"server": {"grace_seconds": 2}, "datasets": DATASETS})
    started: list[ServerProcess] = []

    def start(port: int = 0) -> ServerProcess:
        proc = ServerProcess(config, workers=1, port=port, env=server_env()).start()
        started.append(proc)
        return proc

    yield start  # type: ignore[misc]
    for proc in started:  # stop() also reaps the ones a test killed
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGCONT)
        proc.stop()


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def record(ledger, case: str, got: list[list[int]], detail: str = "") -> None:
    """One ledger row for a fault, compared with the failure-free epoch."""
    lost, dup = ledger.compare(flat(got), flat(reference()))
    ledger.record("servers", case, lost=lost, duplicated=dup, detail=detail)
    assert lost == dup == 0


def reference(epoch: int = 0) -> list[list[int]]:
    """The failure-free sequence, from the sampling rule itself (see test_sampling.py)."""
    order = np.random.default_rng([KW["seed"], epoch]).permutation(60)
    return [order[i : i + 2].tolist() for i in range(0, 60, 2)]


def run(addresses: list[str], fault_at: int | None = None, fault=None,
        victim: str | None = None, shared_memory: bool = True,
        data_socket: bool = False) -> list[list[int]]:
    got = []
    with RemoteLoader(addresses, "toy", shared_memory=shared_memory, data_socket=data_socket,
                      **KW) as loader:
        for k, batch in enumerate(loader):
            got.append(batch["sample_index"].tolist())
            if k == fault_at:
                fault()
        stats = loader.stats()
    if victim is not None:  # the client noticed: not a run that merely got lucky
        assert stats["servers"][victim]["state"] != "up" or stats["hedges"] > 0, stats
    return got


@pytest.mark.parametrize("n", [1, 2, 3])
def test_any_number_of_servers_gives_the_same_sequence(servers, n: int) -> None:
    procs = [servers() for _ in range(n)]
    with RemoteLoader([p.address for p in procs], "toy", **KW) as loader:
        got = [b["sample_index"].tolist() for b in loader]
        used = [s["batches"] for s in loader.stats()["servers"].values()]
    assert got == reference()
    assert len(used) == n and all(u > 0 for u in used)  # every server did some of the work


@pytest.mark.parametrize(("n", "sig", "shm"), [
    (2, signal.SIGKILL, True), (3, signal.SIGKILL, True), (2, signal.SIGTERM, True),
    (3, signal.SIGTERM, True), (2, signal.SIGSTOP, True), (3, signal.SIGSTOP, True),
    # Through the socket, as between machines (the others read same-host shared memory);
    # "data": payloads on the data socket beside gRPC.
    (2, signal.SIGKILL, False), (3, signal.SIGSTOP, False),
    (2, signal.SIGKILL, "data"), (2, signal.SIGSTOP, "data")])
def test_a_server_failing_mid_epoch_loses_and_repeats_nothing(servers, ledger, n: int, sig,
                                                              shm: bool | str) -> None:
    procs = [servers() for _ in range(n)]
    victim = procs[0].proc
    got = run([p.address for p in procs], fault_at=5, fault=lambda: victim.send_signal(sig),
              victim=procs[0].address, shared_memory=shm is True,
              data_socket=shm == "data")
    path = {True: "shared memory", False: "gRPC frames", "data": "data socket"}[shm]
    record(ledger, f"{signal.Signals(sig).name} one of {n} mid-epoch ({path})", got)
    assert got == reference()


def test_all_servers_down_then_one_back_completes_the_epoch(servers, ledger) -> None:
    a, b = servers(), servers()
    port = a.ready["grpc_port"]

    def outage() -> None:
        for p in (a, b):
            p.proc.kill()
            p.proc.wait()
        servers(port=port)  # restarted on the same address, within the retry window

    got = run([a.address, b.address], fault_at=8, fault=outage)
    record(ledger, "kill -9 both of 2, restart one on its port", got)
    assert got == reference()


def test_resume_with_a_different_number_of_servers(servers) -> None:
    procs = [servers() for _ in range(3)]
    with RemoteLoader([p.address for p in procs], "toy", **KW) as loader:
        first = []
        for batch in loader:
            first.append(batch["sample_index"].tolist())
            if len(first) == 11:
                state = loader.state_dict()
                break
    with RemoteLoader(procs[2].address, "toy", **KW) as resumed:
        resumed.load_state_dict(state)
        rest = [b["sample_index"].tolist() for b in resumed]
    assert first + rest == reference()


def test_all_servers_gone_for_good_is_an_error_naming_them(servers, ledger) -> None:
    a = servers()
    address = a.address
    got = []
    with RemoteLoader(address, "toy", **{**KW, "timeout": 3}) as loader:
        it = iter(loader)
        got.append(next(it)["sample_index"].tolist())
        a.proc.kill()
        a.proc.wait()
        with pytest.raises(Exception) as info:
            for batch in it:
                got.append(batch["sample_index"].tolist())
    lost, dup = ledger.compare(flat(got), flat(reference()[: len(got)]))
    ledger.record("servers", "kill -9 the only server, for good", lost=lost, duplicated=dup,
                  detail="clear error naming the address and its last error")
    assert lost == dup == 0
    assert address in str(info.value) and "last error" in str(info.value)


def test_a_dns_name_stands_for_its_servers(servers) -> None:
    server = servers()
    with RemoteLoader(f"dns:///localhost:{server.ready['grpc_port']}", "toy", **KW) as loader:
        assert [b["sample_index"].tolist() for b in loader] == reference()
        assert f"127.0.0.1:{server.ready['grpc_port']}" in loader.stats()["servers"]


@pytest.mark.parametrize("address", ["nohost", "host:port", [], ["dns:///a:1", "b:2"]])
def test_a_malformed_address_is_a_clear_error(address) -> None:
    with pytest.raises(ValueError, match="address"):
        RemoteLoader(address, "toy", batch_size=2)


def test_time_the_loop_spends_elsewhere_is_not_a_timeout(servers) -> None:
    server = servers()
    compute = 1.5  # seconds of "training step", longer than the loader's timeout
    with RemoteLoader(server.address, "toy", **{**KW, "timeout": 1.0}) as loader:
        got = []
        for batch in loader:
            got.append(batch["sample_index"].tolist())
            if len(got) == 3:
                time.sleep(compute)
    assert got == reference()


def test_a_rolling_restart_of_both_servers_loses_and_repeats_nothing(servers, ledger) -> None:
    """Each server in turn: SIGTERM (it drains: finishes what was asked, refuses new credits
    in-band), wait for its exit, start a new one on the same port; the client carries on."""
    procs = [servers(), servers()]
    ports = [int(p.address.rsplit(":", 1)[1]) for p in procs]

    def restart(i: int) -> None:
        assert procs[i].stop() == 0, procs[i].stderr  # SIGTERM; a clean drain exits 0
        procs[i] = servers(port=ports[i])

    steps = {4: lambda: restart(0), 14: lambda: restart(1)}
    got = []
    with RemoteLoader([p.address for p in procs], "toy", **KW) as loader:
        for k, batch in enumerate(loader):
            got.append(batch["sample_index"].tolist())
            if k in steps:
                steps[k]()
        stats = loader.stats()
    record(ledger, "rolling restart of 2 (SIGTERM, restart on the same port, in turn)", got)
    assert got == reference()
    assert all(s["batches"] > 0 for s in stats["servers"].values())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_only_server_restarted_mid_epoch_loses_and_repeats_nothing(servers, ledger,
                                                                      sig) -> None:
    """One server, stopped (drained, or killed) and started again on its port mid-epoch:
    the client waits through the gap, within its timeout, and carries on."""
    procs = [servers()]
    port = int(procs[0].address.rsplit(":", 1)[1])

    def restart() -> None:
        code = procs[0].stop(sig)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL), procs[0].stderr
        procs[0] = servers(port=port)

    got = run([procs[0].address], fault_at=5, fault=restart)
    record(ledger, f"restart the only server mid-epoch ({signal.Signals(sig).name}, same "
                   "port)", got)
    assert got == reference()


def test_the_only_server_frozen_then_thawed_loses_and_repeats_nothing(servers, ledger) -> None:
    """SIGSTOP the only server mid-epoch, SIGCONT it 1.5 s later (past the client's stall
    patience, within its timeout): the client waits, then takes the epoch up where it was."""
    server = servers()
    thawed = threading.Event()

    def freeze() -> None:
        server.proc.send_signal(signal.SIGSTOP)
        threading.Thread(target=lambda: thawed.wait(1.5) or server.proc.send_signal(
            signal.SIGCONT), daemon=True).start()

    got = run([server.address], fault_at=5, fault=freeze)
    record(ledger, "SIGSTOP the only server, SIGCONT it 1.5 s later", got)
    assert got == reference()


@pytest.mark.parametrize("during_restart", [False, True])
def test_a_frozen_server_that_thaws_is_used_again(servers, ledger, during_restart: bool) -> None:
    """SIGSTOP one of two mid-epoch, SIGCONT it later: what it held is asked of the other
    meanwhile, it comes back up and takes credits again, and nothing arrives twice. With
    `during_restart`, the other server is restarted (SIGTERM, same port) while one is frozen."""
    procs = [servers(), servers()]
    frozen, other = procs[0], procs[1]
    port = int(other.address.rsplit(":", 1)[1])
    seen: dict[str, int] = {}

    def restart_other() -> None:
        assert procs[1].stop() == 0, procs[1].stderr
        procs[1] = servers(port=port)

    steps = {3: lambda: frozen.proc.send_signal(signal.SIGSTOP),
             10: lambda: frozen.proc.send_signal(signal.SIGCONT)}
    if during_restart:
        steps[6] = restart_other
    got = []
    with RemoteLoader([p.address for p in procs], "toy", **KW) as loader:
        for k, batch in enumerate(loader):
            got.append(batch["sample_index"].tolist())
            if k in steps:
                steps[k]()
            if k == 10:
                seen = {a: s["batches"] for a, s in loader.stats()["servers"].items()}
        stats = loader.stats()
    after = stats["servers"][frozen.address]
    case = "SIGSTOP one of 2, SIGCONT it later"
    record(ledger, case + (" while the other restarts" if during_restart else ""), got,
           detail=f"thawed server delivered {after['batches'] - seen[frozen.address]} batches "
                  f"after SIGCONT; {stats['failovers']} failovers, {stats['hedges']} hedges")
    assert got == reference()
    assert after["state"] == "up" and after["batches"] > seen[frozen.address]
