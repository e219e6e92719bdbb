"""The HTTP control plane of a real server: probes, metrics as batches flow, the datasets,
live stats, the clients' reported data stall, and readiness during a drain."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from stoker.client import RemoteError, RemoteLoader
from stoker.v1 import stoker_pb2 as pb

pytestmark = pytest.mark.timeout(120)

DATASETS = {"toy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 40}},
            "flaky": {"format": "python", "factory": "toy_datasets:toy",
                      "options": {"n": 40, "fail_at": [13]}},
            "slow": {"format": "python", "factory": "toy_datasets:toy",
                     "options": {"n": 800, "delay": 0.01}}}


def get(server, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(server.http_url + path, timeout=30) as r:
            body = r.read().decode()
            status = r.status
            kind = r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        with e:  # it holds the connection
            body, status, kind = e.read().decode(), e.code, e.headers.get("content-type", "")
    return status, json.loads(body) if "json" in kind else body


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text, 0 when absent."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
            return float(m.group(2))
    return 0.0


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module(DATASETS, workers=2)


def test_probes_datasets_and_the_openapi_document(server) -> None:
    assert get(server, "/healthz") == (200, {"status": "ok"})
    assert get(server, "/readyz") == (200, {"ready": True, "workers": 2, "draining": False})
    status, datasets = get(server, "/v1/datasets")
    assert status == 200 and [d["name"] for d in datasets] == ["flaky", "slow", "toy"]
    status, toy = get(server, "/v1/datasets/toy")
    assert status == 200 and toy["format"] == "python" and toy["num_samples"] == 40
    fields = {f["name"]: (f["dtype"], f["shape"]) for f in toy["fields"]}
    assert fields["x"] == ("float32", [3]) and fields["sample_index"] == ("int64", [])
    status, missing = get(server, "/v1/datasets/nope")
    assert status == 404 and "no dataset 'nope'" in missing["detail"] and "toy" in missing["detail"]
    status, doc = get(server, "/openapi.json")
    assert status == 200
    assert {"/healthz", "/readyz", "/metrics", "/v1/datasets", "/v1/datasets/{name}",
            "/v1/stats"} <= set(doc["paths"])
    status, viewer = get(server, "/docs")  # FastAPI's viewer of that document
    assert status == 200 and "openapi.json" in viewer


def test_metrics_count_what_flows(server) -> None:
    before = get(server, "/metrics")[1]
    with RemoteLoader(server.address, "toy", batch_size=4, output="numpy", timeout=60,
                      prefetch_next_epoch=False) as ld:
        n = sum(1 for _ in ld)
        transport = ld.stats()["transport"]  # same host: the data connection
    text = get(server, "/metrics")[1]
    sent = (metric(text, "stoker_batches_total", dataset="toy", transport=transport)
            - metric(before, "stoker_batches_total", dataset="toy", transport=transport))
    assert sent == n == 10
    assert (metric(text, "stoker_samples_total", dataset="toy")
            - metric(before, "stoker_samples_total", dataset="toy")) == 40
    assert metric(text, "stoker_payload_bytes_total", dataset="toy", transport=transport) > 0
    assert metric(text, "stoker_batch_build_seconds_count", dataset="toy") >= 10
    assert metric(text, "stoker_worker_busy_seconds_total") > 0
    # The stream's end reaches the server's event loop a moment after close(): probe.
    deadline = time.monotonic() + 10
    while metric(text, "stoker_active_streams", dataset="toy") and time.monotonic() < deadline:
        text = get(server, "/metrics")[1]
    assert metric(text, "stoker_active_streams", dataset="toy") == 0
    assert metric(text, "stoker_workers") == 2

    with pytest.raises(RemoteError):  # sample 13 fails: DATA_LOSS, counted by kind
        with RemoteLoader(server.address, "flaky", batch_size=4, shuffle=False,
                          output="numpy", timeout=60) as ld:
            list(ld)
    text = get(server, "/metrics")[1]
    assert metric(text, "stoker_batch_errors_total", dataset="flaky", kind="data_loss") >= 1


def test_clients_report_their_data_stall_and_stats_show_live_rates(server) -> None:
    seen: dict[str, Any] = {}
    t0 = time.monotonic()
    with RemoteLoader(server.address, "slow", batch_size=2, output="numpy", timeout=60) as ld:
        for _ in ld:  # the first report goes out after a second of iterating
            if time.monotonic() - t0 < 1.5:
                continue
            text = get(server, "/metrics")[1]
            if metric(text, "stoker_client_streams_reporting", dataset="slow") >= 1:
                seen["metrics"] = text
                seen["stats"] = get(server, "/v1/stats")[1]
                break
    assert "metrics" in seen, "no stall report arrived within the epoch"
    stall = metric(seen["metrics"], "stoker_client_data_stall", dataset="slow")
    assert 0 < stall <= 1  # this loop waits for a slow dataset most of the time
    assert metric(seen["metrics"], "stoker_active_streams", dataset="slow") == 1
    slow = seen["stats"]["datasets"]["slow"]
    assert slow["batches_per_s"] > 0 and slow["streams"] == 1 and slow["client_stalls"]
    assert seen["stats"]["workers"] == 2 and seen["stats"]["draining"] is False
    # Batches built and kept for other jobs (cache.shared_batches, on by default).
    assert seen["stats"]["held_batches"] >= 1


def test_readyz_turns_503_while_draining(start_server) -> None:
    server = start_server({"toy": DATASETS["toy"]}, server={"grace_seconds": 20})
    assert get(server, "/readyz")[0] == 200
    coords = pb.Coordinates(dataset="toy", seed=0, epoch=0, shuffle=False, rank=0,
                            world_size=1, batch_size=2, drop_last=True)
    with grpc.insecure_channel(server.address) as channel:
        # A stream that stays open holds the drain for up to grace_seconds.
        call = channel.stream_stream("/stoker.v1.DataService/StreamBatches",
                                     request_serializer=pb.StreamRequest.SerializeToString)(
            iter([pb.StreamRequest(coordinates=coords, batch_indices=[0])]), timeout=60)
        next(call)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        status: tuple[int, Any] = (0, None)
        while time.monotonic() < deadline:  # a probe, polled (bounded) as a kubelet does
            status = get(server, "/readyz")
            if status[0] == 503:
                break
        assert status == (503, {"ready": False, "workers": 1, "draining": True})
        call.cancel()


def test_grpc_reflection_lists_and_describes_the_services(server) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(server.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert {"stoker.v1.DataService", "grpc.health.v1.Health"} <= set(db.get_services())
        service = DescriptorPool(db).FindServiceByName("stoker.v1.DataService")
        assert {m.name for m in service.methods} == {"ListDatasets", "DescribeDataset",
                                                    "StreamBatches", "Provenance"}


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (.ci/run installs it)")
def test_the_live_page_updates_itself_in_a_real_browser(server, tmp_path: Path) -> None:
    # Traffic while the browser looks: a loader on a slow dataset, in a thread.
    stop = threading.Event()

    def stream() -> None:
        with RemoteLoader(server.address, "slow", batch_size=2, output="numpy",
                          timeout=60) as ld:
            for _ in ld:
                if stop.is_set():
                    break

    feeder = threading.Thread(target=stream, daemon=True)
    feeder.start()
    try:
        args = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
                "--virtual-time-budget=4000"]
        dom = subprocess.run([*args, "--dump-dom", server.http_url + "/"], capture_output=True,
                             text=True, timeout=60)
        shot = tmp_path / "page.png"
        subprocess.run([*args, f"--screenshot={shot}", "--window-size=800,420",
                        server.http_url + "/"], capture_output=True, timeout=60, check=True)
    finally:
        stop.set()
        feeder.join(timeout=30)
    assert dom.returncode == 0, dom.stderr[-2000:]
    updates = re.search(r'data-updates="(\d+)"', dom.stdout)
    assert updates and int(updates.group(1)) >= 2  # the script polled /v1/stats, repeatedly
    assert "2 workers" in dom.stdout
    row = re.search(r'<tr data-dataset="slow"><td>slow</td><td>([\d.]+)</td>', dom.stdout)
    assert row and float(row.group(1)) > 0  # live samples/s of the stream above
    assert shot.stat().st_size > 5000  # a picture was drawn (looked at by hand, see the docs)
