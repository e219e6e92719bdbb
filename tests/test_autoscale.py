"""`stoker autoscale`: the decision (a pure function of what was observed) and the loop with
real servers and a real trainer."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from certs import Authority

from stoker.client import RemoteLoader
from stoker.server import write_config
from stoker.server.tools.autoscale import (
    Action,
    Observation,
    Policy,
    decide,
    forget,
    parse_gauge,
)

from conftest import server_env

pytestmark = pytest.mark.timeout(90)

P = Policy(target=0.05, min_servers=1, max_servers=4, cooldown=10, window=5, samples=2,
           memory=100)


def history(*runs: tuple[int, float, float | None]) -> list[Observation]:
    """Observations one a second: runs of (servers, seconds, stall)."""
    out, t = [], 0.0
    for servers, seconds, stall in runs:
        for _ in range(int(seconds)):
            out.append(Observation(t, servers, stall))
            t += 1
    return out


def test_a_stall_above_target_adds_a_server_after_the_cooldown() -> None:
    assert decide(history((1, 9, 0.5)), P).action is Action.HOLD  # cooldown
    d = decide(history((1, 12, 0.5)), P)
    assert d.action is Action.ADD and d.stall == 0.5
    assert decide(history((4, 12, 0.5)), P).action is Action.HOLD  # at max_servers


def test_no_information_never_scales() -> None:
    for n in (1, 2, 4):
        assert decide(history((n, 300, None)), P).action is Action.HOLD
    d = decide(history((2, 300, None), (2, 1, 0.0)), P)  # one sample is not enough
    assert d.action is Action.HOLD and "no information" in d.reason


def test_observations_in_the_cooldown_are_not_judged() -> None:
    # 2 servers stalled; a third joined, and the trainers still report the old stall for a
    # while: the third is not judged on it, and 3 is not remembered as too few.
    h = history((2, 15, 0.3), (3, 9, 0.3), (3, 6, 0.0))
    d = decide(h, P)
    assert d.action is Action.HOLD and "2 servers stalled" in d.reason
    h = history((2, 15, 0.3), (3, 9, 0.3), (3, 6, 0.0), (4, 15, 0.0))
    assert decide(h, P).action is Action.REMOVE  # 4 -> 3: 3 never stalled once settled
    h = history((2, 15, 0.3), (3, 12, 0.3))
    assert decide(h, P).action is Action.ADD  # settled at 3 and still above: add


def test_the_fewest_servers_that_suffice_is_kept() -> None:
    # 3 servers: no stall, try 2; 2 stalls: back to 3; there it stays while 2 is remembered.
    h = history((3, 15, 0.0))
    assert decide(h, P).action is Action.REMOVE
    h = history((3, 15, 0.0), (2, 15, 0.2))
    assert decide(h, P).action is Action.ADD
    h = history((3, 15, 0.0), (2, 15, 0.2), (3, 15, 0.0))
    d = decide(h, P)
    assert d.action is Action.HOLD and "2 servers stalled" in d.reason
    h = history((3, 15, 0.0), (2, 15, 0.2), (3, 120, 0.0))  # past `memory`: try again
    assert decide(h, P).action is Action.REMOVE


def test_a_stall_under_target_but_close_to_it_holds() -> None:
    assert decide(history((3, 15, 0.04)), P).action is Action.HOLD
    assert decide(history((3, 15, 0.02)), P).action is Action.REMOVE
    assert decide(history((1, 15, 0.0)), P).action is Action.HOLD  # min_servers


def test_the_median_ignores_one_outlier() -> None:
    h = history((2, 14, 0.01), (2, 1, 0.9))
    assert decide(h, P).action is Action.REMOVE


def test_what_the_loop_forgets_changes_no_decision_and_keeps_its_history_bounded() -> None:
    # A loop of 5,000 ticks whose decisions are followed (the server count moves) and whose
    # stall is random, sometimes unreported, sometimes at a tick's fraction: every decision on
    # the forgetting history is the one on the whole history, which the loop no longer keeps.
    rng = np.random.default_rng(7)
    whole: list[Observation] = []
    kept: list[Observation] = []
    servers, longest, t = 2, 0, 0.0
    for _ in range(5_000):
        t += float(rng.choice([1.0, 0.5, 1.7]))
        stall = None if rng.random() < 0.1 else float(rng.choice([0.0, 0.02, 0.04, 0.3]))
        seen = Observation(t, servers, stall)
        whole.append(seen)
        kept.append(seen)
        decision = decide(whole, P)
        assert decide(kept, P) == decision, (t, decision)
        kept = forget(kept, P)
        longest = max(longest, len(kept))
        servers += {Action.ADD: 1, Action.REMOVE: -1}.get(decision.action, 0)
    assert {o.servers for o in whole} >= {1, 2, 3, 4}  # the count did move
    assert longest < 200  # runs within memory=100 s, their last window=5 s each


def test_bad_policies_and_gauges() -> None:
    for kw in (dict(target=0), dict(target=1.5), dict(min_servers=0),
               dict(min_servers=3, max_servers=2), dict(cooldown=-1)):
        with pytest.raises(ValueError):
            Policy(**kw)
    text = ('# HELP stoker_client_data_stall_max x\nstoker_client_data_stall_max{dataset="a"} '
            '0.25\nstoker_client_data_stall_max{dataset="b"} NaN\n'
            'stoker_client_data_stall{dataset="a"} 0.5\n')
    assert parse_gauge(text, "stoker_client_data_stall_max") == [0.25]
    assert parse_gauge(text, "stoker_client_data_stall") == [0.5]


@pytest.mark.parametrize("secure", ["plain", "tls", "mtls"])
def test_the_loop_adds_a_server_a_stalled_trainer_finds_and_drains_all_at_the_end(
        tmp_path: Path, secure: str) -> None:
    """A trainer that wants data faster than one server makes it: `stoker autoscale` adds a
    second server, the trainer reads from it (dns target, resolver on the address file);
    with the trainer gone the stall is absent and nothing is removed; SIGTERM drains all.
    Under TLS the servers serve /metrics over https, read with the fleet's CA (and, under
    mutual TLS, a client certificate: without one, or without the CA, nothing would scale)."""
    server: dict[str, Any] = {"grace_seconds": 5}
    flags: list[str] = []
    tls: Any = False
    if secure != "plain":
        ca = Authority(tmp_path)
        cert, client = ca.issue("server", server=True), ca.issue("client", server=False)
        server["tls"] = {"cert_file": str(cert.cert), "key_file": str(cert.key)}
        flags, tls = ["--tls-ca", str(ca.ca)], {"ca": str(ca.ca)}
        if secure == "mtls":
            server["tls"]["client_ca_file"] = str(ca.ca)
            flags += ["--tls-cert", str(client.cert), "--tls-key", str(client.key)]
            tls |= {"cert": str(client.cert), "key": str(client.key)}
    config = write_config(tmp_path / "c.yaml", {"server": server, "datasets": {
        "toy": {"format": "python", "factory": "toy_datasets:toy",
                "options": {"n": 100_000, "delay": 0.01}}}})
    listing = tmp_path / "servers.txt"
    cmd = [sys.executable, "-m", "stoker.server.cli", "autoscale", "--config", str(config),
           "--addresses", str(listing), "--max-servers", "2", "--cooldown", "2", "--window",
           "1.5", "--interval", "0.25", "--workers", "1", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **server_env()})
    rows: queue.Queue[dict] = queue.Queue()
    reader = threading.Thread(target=lambda: [rows.put(json.loads(x)) for x in proc.stdout],
                              daemon=True)
    reader.start()
    trace: list[dict] = []

    def until(cond, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                row = rows.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            trace.append(row)
            if cond(row):
                return row
        raise AssertionError(f"not seen within {timeout} s; trace: {trace}")

    try:
        until(lambda r: r["servers"] == 1, 60)  # up, and ticking
        seen: set[str] = set()
        with RemoteLoader("dns:///local:0", "toy", batch_size=4, shuffle=False,
                          output="numpy", prefetch=4, dns_refresh=0.1, tls=tls,
                          resolver=lambda target: listing.read_text().split()) as loader:
            it = iter(loader)
            expected = 0
            while True:  # no compute: the loop waits for every batch (stall ~100%)
                got = next(it)["sample_index"].tolist()
                assert got == list(range(expected, expected + 4))
                expected += 4
                served = {a for a, s in loader.stats()["servers"].items() if s["batches"]}
                seen |= served
                if len(seen) == 2:
                    break
                if not rows.empty():
                    until(lambda r: True, 1)
                assert len(trace) < 400, trace
        assert any(r["action"] == "add" and r["servers"] == 1 for r in trace), trace
        # Trainer gone: its stall expires from the servers' metrics after a minute; until
        # then the last report stays. Either way the loop never removes on no information.
        later = until(lambda r: r["servers"] == 2 and ("max_servers" in r["reason"]
                                                       or "no information" in r["reason"]), 30)
        assert later["servers"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        err = proc.stderr.read()
        proc.stderr.close()
        reader.join(10)  # reads stdout to its end
        proc.stdout.close()
    assert proc.returncode == 0, err
    assert listing.read_text() == ""  # every server drained and off the list
    assert not any(r["action"] == "remove" for r in trace), trace


def test_metrics_over_mutual_tls_are_read_with_the_ca_and_a_client_certificate(
        tmp_path: Path, start_server) -> None:
    """read_stall against a server with client_ca_file: without the CA, or without a client
    certificate, it reads nothing and says why (Autoscaler logs it once per server); with
    both it reads the page (no stall series yet: None, with nothing said)."""
    import ssl

    from stoker.server.tools.autoscale import read_stall
    from stoker.server.tools.connect import Security, https_context

    ca = Authority(tmp_path)
    cert, client = ca.issue("server", server=True), ca.issue("client", server=False)
    server = start_server({"toy": {"format": "python", "factory": "toy_datasets:toy"}},
                          server={"tls": {"cert_file": str(cert.cert), "key_file": str(cert.key),
                                          "client_ca_file": str(ca.ca)}})
    assert server.http_url.startswith("https://")
    full = https_context(Security({"ca": str(ca.ca), "cert": str(client.cert),
                                   "key": str(client.key)}, None, None), "autoscale")
    for context, why in ((None, "certificate verify failed"),
                         (ssl.create_default_context(cafile=str(ca.ca)), ""),
                         (full, None)):
        said: list[BaseException] = []
        assert read_stall(server.http_url, context=context, failed=said.append) is None
        if why is None:
            assert said == []
        else:
            assert len(said) == 1 and why in str(said[0]), said
