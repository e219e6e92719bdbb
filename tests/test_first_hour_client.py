"""Issue 20, the training client's first contact and its surprises (items 2, 4, 5, 6, 7, 12,
13): each test is named after its item and runs against real servers (tests/conftest.py)."""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from certs import Authority

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess, write_config

from conftest import server_env

pytestmark = pytest.mark.timeout(60)

TOY = {"format": "python", "factory": "toy_datasets:toy"}
DATASETS = {"eighty": {**TOY, "options": {"n": 80}},
            "waits": {**TOY, "options": {"n": 4, "delay": 0.9}}}
MAX_CREDITS = 4


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module(DATASETS, workers=2, server={"max_credits": MAX_CREDITS})


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STOKER_TOKEN", raising=False)


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(server: ServerProcess) -> str:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=30) as r:
        return r.read().decode()


def series(text: str, name: str, dataset: str) -> float | None:
    """One series' value in Prometheus text; None when the series is absent."""
    m = re.search(rf'^{name}\{{dataset="{dataset}"\}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else None


def first_contact_error(address: str, **kw: Any) -> tuple[RemoteError, float]:
    """The error len() raises against `address`, and how long it took."""
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as err:
        with RemoteLoader(address, "eighty", batch_size=8, **kw) as loader:
            len(loader)
    return err.value, time.monotonic() - t0


def answered_in(err: RemoteError) -> float:
    """The figure of `no data server answered in X s`."""
    m = re.search(r"no data server answered in ([\d.]+)s", str(err))
    assert m, str(err)
    return float(m.group(1))


# -- item 2 ------------------------------------------------------------------------------------
def test_item_2_a_wrong_address_fails_fast_naming_it(caplog, ledger) -> None:
    caplog.set_level(logging.INFO, logger="stoker.client")
    refused, unresolved = f"127.0.0.1:{free_port()}", "no-such-host.invalid:50051"
    found = {}
    for address in (refused, unresolved):
        err, took = first_contact_error(address, connect_timeout=1.2, timeout=300)
        assert err.code == grpc.StatusCode.UNAVAILABLE
        assert 1.2 <= took < 6, took  # connect_timeout, not the 300 s timeout
        assert abs(answered_in(err) - took) < 0.5, (str(err), took)  # the figure is true
        assert address in str(err) and "connect_timeout=1.2" in str(err)
        found[address] = str(err)
    assert "refused the connection (nothing listens on that port)" in found[refused]
    assert "'no-such-host.invalid' does not resolve" in found[unresolved]
    waiting = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(waiting) == 2 and refused in waiting[0], waiting  # said what it waits for
    ledger.record("clients", "a loader given an address nothing listens on, and a name that "
                  "does not resolve", tried=2, detail="UNAVAILABLE after connect_timeout, "
                  "naming each address and what a TCP connect to it found")


def test_item_2_once_a_server_answered_a_restart_longer_than_connect_timeout_passes(
        tmp_path: Path, ledger) -> None:
    config = write_config(tmp_path / "config.yaml", {"datasets": {"eighty": DATASETS["eighty"]}})
    first = ServerProcess(config, workers=1, env=server_env()).start()
    port = int(first.address.rsplit(":", 1)[1])
    second = None
    got: list[int] = []
    try:
        with RemoteLoader(first.address, "eighty", batch_size=8, shuffle=False, prefetch=2,
                          output="numpy", connect_timeout=0.2, timeout=60) as loader:
            for k, batch in enumerate(loader):
                got += batch["sample_index"].tolist()
                if k == 2:  # down for a server's start-up time, far above connect_timeout
                    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
                    second = ServerProcess(config, workers=1, port=port,
                                           env=server_env()).start()
    finally:
        if second is not None:
            assert second.stop() == 0, second.stderr
    lost, dup = ledger.compare(got, list(range(80)))
    ledger.record("servers", "kill -9 the only server and restart it, mid-epoch, with "
                  "connect_timeout far below the restart time", lost=lost, duplicated=dup)
    assert lost == dup == 0


# -- item 4 ------------------------------------------------------------------------------------
def test_item_4_zero_batches_is_an_error_and_dropped_samples_a_warning(server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="stoker.client")
    kw = dict(output="numpy", prefetch=MAX_CREDITS)
    with RemoteLoader(server.address, "eighty", batch_size=256, **kw) as loader:
        for attempt in (len, list):
            with pytest.raises(ValueError) as err:
                attempt(loader)
            assert ("dataset 'eighty' has 80 samples: batch_size=256 with drop_last=True gives "
                    "no batch per epoch") in str(err.value)
            assert "drop_last=False" in str(err.value)
    with RemoteLoader(server.address, "eighty", batch_size=256, drop_last=False,
                      **kw) as loader:
        assert [len(b["sample_index"]) for b in loader] == [80]  # one short batch
    with RemoteLoader(server.address, "eighty", batch_size=32, **kw) as loader:
        assert len(loader) == 2
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert ("dataset 'eighty' has 80 samples: drop_last=True leaves out the last 16 of this "
            "rank's 80 samples every epoch (batch_size=32 makes 2 full batches") in warned[0]\
        .getMessage()


# -- item 5 ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mtls_server(start_server_module, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[ServerProcess, Path]:
    """A mutual-TLS server on 127.0.0.1, and its CA."""
    ca = Authority(tmp_path_factory.mktemp("pki"))
    pair = ca.issue("server", server=True)
    proc = start_server_module({"eighty": DATASETS["eighty"]}, server={"tls": {
        "cert_file": str(pair.cert), "key_file": str(pair.key), "client_ca_file": str(ca.ca)}})
    return proc, ca.ca


def test_item_5_tls_mistakes_are_named_whichever_address_of_a_name_failed(
        mtls_server, ledger) -> None:
    server, ca = mtls_server
    port = server.ready["grpc_port"]
    # gRPC tries [::1] as well for localhost, and its error names that one, refused.
    no_cert, took = first_contact_error(f"localhost:{port}", tls={"ca": str(ca)},
                                        connect_timeout=1)
    assert f"127.0.0.1:{port} accepts TCP connections, but no gRPC call got through" in str(
        no_cert)
    assert "a server with client_ca_file needs tls['cert'] and tls['key']" in str(no_cert)
    assert abs(answered_in(no_cert) - took) < 0.5 and answered_in(no_cert) >= 1
    plain, _ = first_contact_error(f"localhost:{port}", connect_timeout=1)
    assert "if the server uses TLS, pass tls=True" in str(plain)
    ledger.record("security", "localhost (several addresses) against a mutual-TLS server "
                  "on 127.0.0.1: no client certificate, and no TLS", tried=2,
                  detail="UNAVAILABLE after connect_timeout with the TLS hint")


# -- item 6 ------------------------------------------------------------------------------------
def test_item_6_log_every_shows_without_logging_configured(server) -> None:
    script = textwrap.dedent(f"""
        import logging, sys
        from stoker.client import RemoteLoader
        def read_all():
            with RemoteLoader({server.address!r}, "eighty", batch_size=8, output="numpy",
                              prefetch=4, log_every=1e-9) as loader:
                list(loader)
        read_all()
        print("CONFIGURED", file=sys.stderr, flush=True)
        logging.basicConfig(level=logging.WARNING)  # the program's choice: INFO stays quiet
        read_all()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr
    before, _, after = out.stderr.partition("CONFIGURED")
    lines = re.findall(r"^stoker\.client: eighty epoch 0: batch (\d+)/10, .* data stall",
                       before, re.MULTILINE)
    assert lines and lines[-1] == "10", before
    assert "eighty epoch" not in after, after


# -- item 7 ------------------------------------------------------------------------------------
def test_item_7_prefetch_above_max_credits_is_clamped_at_first_contact(server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="stoker.client")
    with RemoteLoader(server.address, "eighty", batch_size=4, prefetch=16, shuffle=False,
                      output="numpy") as loader:
        got = [i for b in loader for i in b["sample_index"].tolist()]
    assert got == list(range(80))  # no RESOURCE_EXHAUSTED mid-epoch
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and (f"prefetch=16 is more than the server's max_credits="
                                 f"{MAX_CREDITS} ({server.address})") in warned[0], warned


# -- item 12 -----------------------------------------------------------------------------------
def test_item_12_the_stall_is_absent_until_reported_and_reported_on_time(server,
                                                                         caplog) -> None:
    caplog.set_level(logging.INFO, logger="stoker.client")
    assert series(metrics(server), "stoker_client_data_stall", "waits") is None
    # A loop stuck waiting for its first batch (4 samples of 0.9 s) reports while it waits,
    # and says what it waits for (item 2: after 3 s).
    handed: list[int] = []
    done = threading.Event()

    def waiting_loop() -> None:
        with RemoteLoader(server.address, "waits", batch_size=4, output="numpy",
                          prefetch=MAX_CREDITS) as loader:
            handed.extend(len(b["sample_index"]) for b in loader)
        done.set()

    thread = threading.Thread(target=waiting_loop, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    stall = None
    while stall is None and not done.is_set() and time.monotonic() < deadline:
        stall = series(metrics(server), "stoker_client_data_stall", "waits")
        seen_before_a_batch = not handed
        done.wait(0.05)  # pace the polling
    thread.join(30)
    assert stall is not None and stall > 0.5 and seen_before_a_batch, (stall, handed)
    said = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("waits epoch 0: waiting 3s for batch 0 ") \
        and f"{server.address}: " in said[0] and "last error" in said[0], said
    # Short epochs (well under a second each) report too: each new stream is told at once.
    with RemoteLoader(server.address, "eighty", batch_size=8, output="numpy",
                      prefetch=MAX_CREDITS) as loader:
        t0, reported = time.monotonic(), None
        while reported is None and time.monotonic() - t0 < 20:
            for _ in loader:  # 10 batches: an epoch takes a small part of a second
                if time.monotonic() - t0 > 1.2:  # past the first report; a stream is open
                    reported = series(metrics(server), "stoker_client_data_stall", "eighty")
                    if reported is not None:
                        break
    assert reported is not None and 0 <= reported <= 1
    # No stream reports any more: unknown (absent), not 0. The server learns of the last stream's
    # end when its call is torn down, a moment after the loader closed: wait for that, bounded
    # well under REPORT_TTL (60 s), so a stream end that is not heard still fails here.
    deadline = time.monotonic() + 20
    text = metrics(server)
    while (series(text, "stoker_client_data_stall", "eighty") is not None
           and time.monotonic() < deadline):
        time.sleep(0.05)  # a poll of the server's figures, bounded by the deadline
        text = metrics(server)
    assert series(text, "stoker_client_data_stall", "eighty") is None
    assert series(text, "stoker_client_data_stall_max", "eighty") is None
    assert series(text, "stoker_client_streams_reporting", "eighty") == 0


# -- item 13 -----------------------------------------------------------------------------------
def test_item_13_load_state_dict_names_the_keys_that_differ() -> None:
    saved = RemoteLoader("127.0.0.1:1", "eighty", batch_size=8, seed=3).state_dict()
    with pytest.raises(ValueError) as err:
        RemoteLoader("127.0.0.1:1", "eighty", batch_size=4, seed=3, shuffle=False,
                     drop_last=False).load_state_dict(saved)
    text = str(err.value)
    assert "drop_last: saved True, this loader False" in text and "shuffle: saved True, this " \
        "loader False" in text
    # Only what differs, and batch_size may (issue 16, elastic resume: docs/client.md#resuming).
    assert "seed" not in text and "dataset" not in text and "batch_size:" not in text
    with pytest.raises(ValueError, match="has no 'coordinates'"):
        RemoteLoader("127.0.0.1:1", "eighty", batch_size=8).load_state_dict({"epoch": 1})
