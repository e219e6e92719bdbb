"""TLS, the bearer token, limits and paths, against real servers with real TLS handshakes
(certificates made here, tests/certs.py). Every refusal is recorded in the ledger."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from certs import Authority, Pair
from epochs import epoch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from stoker.client import RemoteError, RemoteLoader
from stoker.client.transport.samehost import probe
from stoker.server import ServerProcess, write_config
from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import stoker_pb2_grpc as pb_grpc

from conftest import server_env

pytestmark = pytest.mark.timeout(90)

TOKEN = "t0k3n-for-tests-" + "a1b2c3d4e5f6"
NOISE = {"noise": {"format": "python", "factory": "toy_datasets:Noise",
                   "options": {"n": 12, "shape": [64, 64]}}}
STREAM = "/stoker.v1.DataService/StreamBatches"


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STOKER_TOKEN", raising=False)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = Authority(folder), Authority(folder, "another CA")
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    return {"ca": ca.ca, "server": ca.issue("server", server=True),
            "client": ca.issue("client", server=False),
            "stranger": other.issue("stranger", server=False), "token_file": token_file}


@pytest.fixture(scope="module")
def tls_server(start_server_module, pki):
    """TLS (server certificate only) and the bearer token."""
    return start_server_module(NOISE, server={
        "tls": {"cert_file": str(pki["server"].cert), "key_file": str(pki["server"].key)},
        "auth_token_file": str(pki["token_file"])})


@pytest.fixture(scope="module")
def mtls_server(start_server_module, pki):
    return start_server_module(NOISE, server={
        "tls": {"cert_file": str(pki["server"].cert), "key_file": str(pki["server"].key),
                "client_ca_file": str(pki["ca"])}})


LIMITS = {"max_streams_per_client": 2, "max_batch_bytes": 65536, "max_request_bytes": 4096,
          "max_credits": 4}


@pytest.fixture(scope="module")
def limited_server(start_server_module):
    return start_server_module(NOISE, server=LIMITS)


READ = {"batch_size": 3, "timeout": 30, "shuffle": False}  # every epoch() here


def coords(dataset: str = "noise", batch_size: int = 3) -> pb.Coordinates:
    return pb.Coordinates(dataset=dataset, seed=0, epoch=0, shuffle=False, rank=0, world_size=1,
                          batch_size=batch_size, drop_last=True)


def raw_stream(channel: grpc.Channel, first: pb.StreamRequest, hold: threading.Event | None = None,
               metadata: Any = None) -> Any:
    """A StreamBatches call; with `hold`, its request side stays open until that is set."""
    def requests() -> Iterator[pb.StreamRequest]:
        yield first
        if hold is not None:
            hold.wait(60)

    method = channel.stream_stream(STREAM, request_serializer=pb.StreamRequest.SerializeToString,
                                   response_deserializer=pb.BatchFrame.FromString)
    return method(requests(), timeout=30, metadata=metadata)


def tls_channel(server: Any, pki: dict[str, Any], client: Pair | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        pki["ca"].read_bytes(), client.key.read_bytes() if client else None,
        client.cert.read_bytes() if client else None)
    return grpc.secure_channel(server.address, creds)


# -- TLS ---------------------------------------------------------------------------------------
def test_a_tls_client_with_the_token_gets_every_batch_over_grpc_and_shared_memory(
        tls_server, pki) -> None:
    assert tls_server.ready["tls"] and tls_server.ready["auth"]
    tls = {"ca": str(pki["ca"])}
    framed = epoch(tls_server, "noise", tls=tls, token=TOKEN, shared_memory=False,
                   **READ).arrays()
    shared = epoch(tls_server, "noise", tls=tls, token=TOKEN, **READ).arrays()
    assert framed["sample_index"].tolist() == list(range(12))
    for k in framed:
        assert np.array_equal(framed[k], shared[k]), k


def test_a_plain_client_against_a_tls_server_fails_with_a_clear_error(tls_server, ledger) -> None:
    with pytest.raises(RemoteError) as err:
        epoch(tls_server, "noise", token=TOKEN, **{**READ, "timeout": 2})
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "tls" in str(err.value).lower(), str(err.value)
    ledger.record("security", "plain-text client against a TLS server", tried=1,
                  detail="refused at the handshake; the error suggests tls=")


def test_batches_travel_on_a_tls_data_connection_under_tls(tls_server, pki, ledger) -> None:
    """Under TLS the data connection is TLS too, with the same certificate: the loader gets
    byte-identical batches on it; a plain-TCP claim and a TLS claim without the bearer
    token's proof get no byte of a batch."""
    tls = {"ca": str(pki["ca"])}
    shared = epoch(tls_server, "noise", tls=tls, token=TOKEN, **READ).arrays()
    with RemoteLoader(tls_server.address, "noise", batch_size=3, output="numpy", shuffle=False,
                      tls=tls, token=TOKEN, shared_memory=False, timeout=30) as loader:
        batches = list(loader)
        stats = loader.stats()
    assert stats["transport"] == "data_socket"
    assert stats["transports"][tls_server.address]["why"] == "TLS"
    for k in shared:
        assert np.array_equal(shared[k], np.concatenate([b[k] for b in batches]))
    with tls_channel(tls_server, pki) as channel:
        call = raw_stream(channel, pb.StreamRequest(coordinates=coords(), batch_indices=[0],
                                                    data_socket=True),
                          metadata=[("authorization", f"Bearer {TOKEN}")])
        offer = next(call).data_socket
        assert offer.proof and offer.port == tls_server.ready["data_port"]
        token = bytes(offer.token)
        proof = hmac.new(TOKEN.encode(), token, hashlib.sha256).digest()
        # Plain TCP: the handshake fails; at most a TLS alert comes back, never a record.
        with socket.create_connection(("127.0.0.1", offer.port), timeout=30) as sock:
            sock.sendall(token + proof)
            reply = _read_all(sock)
            assert len(reply) < 64 and (not reply or reply[0] == 0x15), reply[:20]
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        with context.wrap_socket(socket.create_connection(("127.0.0.1", offer.port),
                                                          timeout=30),
                                 server_hostname="localhost") as sock:
            sock.sendall(token + bytes(32))  # the token, a wrong proof
            assert _read_all(sock) == b""
        call.cancel()
    ledger.record("security", "data connection under TLS: a plain-TCP claim, a TLS claim "
                  "with a wrong proof of the token", tried=2,
                  detail="no byte of a batch to either; the loader's batches equal shm's")


def _read_all(sock: socket.socket) -> bytes:
    """Whatever the server sends until it closes (a reset counts as closed)."""
    out = b""
    try:
        while more := sock.recv(1 << 16):
            out += more
    except (ConnectionResetError, ssl.SSLError):
        pass
    return out


def test_mutual_tls_lets_in_only_clients_with_a_certificate_its_ca_signed(
        mtls_server, pki, ledger) -> None:
    client = pki["client"]
    tls = {"ca": str(pki["ca"]), "cert": str(client.cert), "key": str(client.key)}
    got = epoch(mtls_server, "noise", tls=tls, **READ).arrays()
    assert len(got["sample_index"]) == 12
    # The data connection asks for the client certificate too: batches identical on it.
    with RemoteLoader(mtls_server.address, "noise", batch_size=3, output="numpy",
                      shuffle=False, tls=tls, shared_memory=False, timeout=30) as loader:
        wired = [b for b in loader]
        assert loader.stats()["transport"] == "data_socket"
    for k in got:
        assert np.array_equal(got[k], np.concatenate([b[k] for b in wired]))
    bare = ssl.create_default_context(cafile=str(pki["ca"]))
    with pytest.raises((ssl.SSLError, ConnectionError)), bare.wrap_socket(
            socket.create_connection(("127.0.0.1", mtls_server.ready["data_port"]),
                                     timeout=30), server_hostname="localhost") as sock:
        sock.sendall(bytes(16))
        if not sock.recv(1):  # TLS 1.3: the refusal comes with the first read
            raise ConnectionError("closed")
    refused = [{"ca": str(pki["ca"])},
               {"ca": str(pki["ca"]), "cert": str(pki["stranger"].cert),
                "key": str(pki["stranger"].key)}]
    for tls in refused:
        with pytest.raises(RemoteError) as err:
            RemoteLoader(mtls_server.address, "noise", batch_size=3, tls=tls,
                         timeout=2).describe()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "noise" not in str(err.value)
    # The HTTP port asks for the client certificate too.
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(mtls_server.http_url + "/v1/datasets", timeout=10,
                               context=context).close()
    context.load_cert_chain(client.cert, client.key)
    with urllib.request.urlopen(mtls_server.http_url + "/healthz", timeout=10,
                                context=context) as r:
        assert r.status == 200
    ledger.record("security", "mutual TLS: no client certificate, or one another CA signed",
                  tried=4, detail="handshake refused (gRPC, HTTP and the data connection)")


# -- the token ---------------------------------------------------------------------------------
def test_tls_files_named_from_the_home_folder_serve_the_data_connection_too(
        mtls_server, pki, monkeypatch: pytest.MonkeyPatch) -> None:
    # `~/...` in `tls` is the home folder for gRPC's credentials and for the data
    # connection's (which handed the raw path to ssl: FileNotFoundError at the loader).
    folder = Path(pki["ca"]).parent
    monkeypatch.setenv("HOME", str(folder))

    def home(path: Any) -> str:
        return "~/" + str(Path(path).relative_to(folder))

    client = pki["client"]
    tls = {"ca": home(pki["ca"]), "cert": home(client.cert), "key": home(client.key)}
    with RemoteLoader(mtls_server.address, "noise", batch_size=3, output="numpy",
                      shuffle=False, tls=tls, shared_memory=False, timeout=30) as loader:
        got = [i for b in loader for i in b["sample_index"].tolist()]
        assert loader.stats()["transport"] == "data_socket"
    assert got == list(range(12))


def test_a_missing_or_wrong_token_is_unauthenticated_and_names_no_dataset(
        tls_server, pki, ledger) -> None:
    tls = {"ca": str(pki["ca"])}
    tried = 0
    for token in (None, "wrong-token-of-good-length", TOKEN + "x", TOKEN[:-1]):
        for action in ("describe", "iterate"):
            loader = RemoteLoader(tls_server.address, "noise", batch_size=3, tls=tls,
                                  token=token, output="numpy", timeout=10)
            with loader, pytest.raises(RemoteError) as err:
                loader.describe() if action == "describe" else next(iter(loader))
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED, (token, action)
            assert "noise" not in str(err.value)
            tried += 1
    with tls_channel(tls_server, pki) as channel:
        for header in ([], [("authorization", TOKEN)], [("authorization", "Basic " + TOKEN)]):
            with pytest.raises(grpc.RpcError) as rpc:
                pb_grpc.DataServiceStub(channel).ListDatasets(pb.ListDatasetsRequest(),
                                                              metadata=header, timeout=10)
            assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "noise" not in rpc.value.details()
            tried += 1
        # Reflection needs the token too; health does not (kubelet gRPC probes send none).
        reflect = channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        with pytest.raises(grpc.RpcError) as rpc:
            list(reflect(iter([b""]), timeout=10))
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    ledger.record("security", "gRPC call without the token, or a wrong one", tried=tried + 1,
                  detail="UNAUTHENTICATED, no dataset named; health stays open")


def test_shared_memory_delivery_needs_the_token_too(tls_server, pki, ledger) -> None:
    with tls_channel(tls_server, pki) as channel:
        call = raw_stream(channel, pb.StreamRequest(coordinates=coords(), batch_indices=[0],
                                                    shm_probe=probe()))
        with pytest.raises(grpc.RpcError) as rpc:
            next(call)
    assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ledger.record("security", "same-host shared-memory stream without the token", tried=1,
                  detail="UNAUTHENTICATED before any segment is named")


def http_get(url: str, ca: Path, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}
                                     if token else {})
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def test_http_needs_the_token_except_for_the_probes(tls_server, pki, ledger) -> None:
    base, ca = tls_server.http_url, pki["ca"]
    assert base.startswith("https://")
    for probe_path in ("/healthz", "/readyz"):
        assert http_get(base + probe_path, ca)[0] == 200
    tried = 0
    for path in ("/v1/datasets", "/v1/datasets/noise", "/v1/stats", "/metrics", "/",
                 "/openapi.json", "/docs"):
        for token in (None, "wrong-token-of-good-length"):
            status, body = http_get(base + path, ca, token)
            assert status == 401 and "noise" not in body, (path, token, body)
            tried += 1
    status, body = http_get(base + "/v1/datasets", ca, TOKEN)
    assert status == 200 and json.loads(body)[0]["name"] == "noise"
    ledger.record("security", "HTTP request without the token, or a wrong one", tried=tried,
                  detail="401, no dataset named; /healthz and /readyz open")


# -- limits ------------------------------------------------------------------------------------
def active_streams(server: Any) -> float:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('stoker_active_streams{dataset="noise"}'):
                return float(line.split()[-1])
    return 0.0


def test_streams_per_client_are_limited(limited_server, ledger) -> None:
    hold = threading.Event()
    with grpc.insecure_channel(limited_server.address) as channel:
        calls = [raw_stream(channel, pb.StreamRequest(coordinates=coords(), batch_indices=[0]),
                            hold) for _ in range(2)]
        for call in calls:
            assert next(call).batch_index == 0  # both streams are open at the server now
        with pytest.raises(grpc.RpcError) as rpc:
            next(raw_stream(channel, pb.StreamRequest(coordinates=coords(), batch_indices=[0])))
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams_per_client=2" in rpc.value.details()
        for call in calls:
            call.cancel()
        hold.set()
    deadline = time.monotonic() + 30  # the server counts them closed: wait on that probe
    while active_streams(limited_server) and time.monotonic() < deadline:
        pass
    assert len(epoch(limited_server, "noise", **READ).indices()) == 12
    ledger.record("security", "streams over max_streams_per_client from one address", tried=1,
                  detail="RESOURCE_EXHAUSTED naming the limit; served again once closed")


def test_a_batch_over_max_batch_bytes_fails_in_band_and_the_server_goes_on(
        limited_server, ledger) -> None:
    with pytest.raises(RemoteError) as err:  # 8 x 64 x 64 float32: 128 KiB
        epoch(limited_server, "noise", **{**READ, "batch_size": 8})
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_batch_bytes (65536)" in str(err.value)
    assert len(epoch(limited_server, "noise", **READ).indices()) == 12
    ledger.record("security", "batch over max_batch_bytes", tried=1,
                  detail="that batch fails in-band, RESOURCE_EXHAUSTED naming the limit")


def test_requests_over_max_request_bytes_and_credits_over_max_credits_are_refused(
        limited_server, ledger) -> None:
    with grpc.insecure_channel(limited_server.address) as channel:
        big = channel.unary_unary("/stoker.v1.DataService/ListDatasets")
        with pytest.raises(grpc.RpcError) as rpc:
            big(b"\x00" * 8192, timeout=10)
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as rpc:  # ~10 KiB of batch indices
            next(raw_stream(channel, pb.StreamRequest(coordinates=coords(),
                                                      batch_indices=[1000] * 5000)))
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as rpc:
            next(raw_stream(channel, pb.StreamRequest(coordinates=coords(),
                                                      batch_indices=[0, 1, 2, 3, 0])))
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_credits=4" in rpc.value.details()
        listed = pb_grpc.DataServiceStub(channel).ListDatasets(pb.ListDatasetsRequest(),
                                                               timeout=10)
    assert [d.name for d in listed.datasets] == ["noise"]  # still serving
    ledger.record("security", "request over max_request_bytes (unary and stream)", tried=2,
                  detail="RESOURCE_EXHAUSTED; the server goes on")
    ledger.record("security", "credits over max_credits in one message", tried=1,
                  detail="RESOURCE_EXHAUSTED naming the limit")


# -- paths -------------------------------------------------------------------------------------
def test_dataset_names_are_looked_up_never_used_as_paths(limited_server, ledger) -> None:
    names = ["../etc", "/etc/passwd", "../../../../etc/passwd", "noise/../noise", "./noise",
             "noise\x00", ""]
    with grpc.insecure_channel(limited_server.address) as channel:
        stub = pb_grpc.DataServiceStub(channel)
        for name in names:
            with pytest.raises(grpc.RpcError) as rpc:
                stub.DescribeDataset(pb.DescribeDatasetRequest(coordinates=coords(name)),
                                     timeout=10)
            assert rpc.value.code() == grpc.StatusCode.NOT_FOUND, name
    ledger.record("security", "dataset names that look like paths", tried=len(names),
                  detail="NOT_FOUND: names are looked up, never joined into paths")


def test_a_symlink_out_of_the_data_folder_is_refused_at_open(start_server, tmp_path,
                                                             ledger) -> None:
    root = tmp_path / "images"
    (root / "cats").mkdir(parents=True)
    Image.new("RGB", (8, 8), (255, 0, 0)).save(root / "cats" / "a.png")
    outside = tmp_path / "secret.png"
    Image.new("RGB", (8, 8), (0, 0, 255)).save(outside)
    (root / "cats" / "leak.png").symlink_to(outside)
    dataset = {"format": "image-folder", "source": str(root), "size": 8}
    config = write_config(tmp_path / "refused.yaml", {"datasets": {"pics": dataset}})
    refused = ServerProcess(config, workers=1, env=server_env())
    with pytest.raises(RuntimeError) as err:
        refused.start()
    assert refused.proc is not None and refused.proc.returncode != 0
    message = str(err.value)
    assert "leak.png" in message and "outside the dataset root" in message
    assert "follow_symlinks_outside_root" in message
    # The operator may allow it, per dataset.
    server = start_server({"pics": {**dataset, "follow_symlinks_outside_root": True}})
    with RemoteLoader(server.address, "pics", batch_size=2, output="numpy", timeout=30,
                      shuffle=False) as loader:
        assert len(next(iter(loader))["label"]) == 2
    ledger.record("security", "symlink from the data folder to a file outside it", tried=1,
                  detail="the dataset does not open, the error names the link")


def test_the_cli_speaks_tls_and_sends_the_token(tls_server, pki) -> None:
    def datasets(*extra: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "stoker.server", "datasets",
                               tls_server.address, "--tls-ca", str(pki["ca"]), *extra],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, **env})

    out = datasets(env={"STOKER_TOKEN": TOKEN})
    assert out.returncode == 0 and out.stdout.splitlines()[1].split()[0] == "noise", out.stderr
    assert datasets("--token-file", str(pki["token_file"]), env={}).returncode == 0
    out = datasets(env={})
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr
    assert "noise" not in out.stderr


@pytest.mark.parametrize("case", ["short token", "bad certificate"])
def test_a_bad_token_or_certificate_stops_the_start_naming_the_file(tmp_path, pki,
                                                                     case) -> None:
    server: dict[str, Any] = {}
    if case == "short token":
        (tmp_path / "token").write_text("short\n")
        server["auth_token_file"] = str(tmp_path / "token")
    else:
        (tmp_path / "junk.pem").write_text("not a certificate\n")
        server["tls"] = {"cert_file": str(tmp_path / "junk.pem"),
                         "key_file": str(pki["server"].key)}
    config = write_config(tmp_path / "c.yaml", {"server": server, "datasets": NOISE})
    out = subprocess.run([sys.executable, "-m", "stoker.server", "serve", "--config",
                          str(config), "--port", "0", "--http-port", "0"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, **server_env()})
    assert out.returncode == 1 and out.stdout == "", out.stderr
    named = str(tmp_path / ("token" if case == "short token" else "junk.pem"))
    assert named in out.stderr and "short\n" not in out.stderr, out.stderr
