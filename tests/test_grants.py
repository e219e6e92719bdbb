"""server.grants (issue 41), red-team style: a credential for one dataset tries to describe,
read, seek, inspect or learn the name of another, over gRPC, the data connection, shared
memory and HTTP, against one real server under mutual TLS (certificates made here,
tests/certs.py). Every attempt is recorded in the reliability ledger."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from certs import Authority, Pair

from stoker.client import RemoteError, RemoteLoader
from stoker.client.transport.samehost import probe
from stoker.server import ServerProcess, write_config
from stoker.server._config import ConfigError, load_config
from stoker.server.front.redact import redact
from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import stoker_pb2_grpc as pb_grpc

from conftest import server_env

pytestmark = pytest.mark.timeout(120)

A_TOKEN = "team-a-token-" + "0123456789abcdef"
OPS_TOKEN = "operators-token-" + "fedcba9876543210"
SHARED_TOKEN = "the-old-shared-" + "token-aaaabbbbcccc"
NOISE = {"format": "python", "factory": "toy_datasets:Noise",
         "options": {"n": 12, "shape": [16, 16]}}
DATASETS = {"alpha": NOISE, "common": NOISE,
            # beta goes through the prefix cache (its `prepare`) and the shared-batch cache.
            "beta": {"format": "python", "factory": "prefix_datasets:Encoded",
                     "prepare": "prefix_datasets:prepare"}}
STREAM = "/stoker.v1.DataService/StreamBatches"


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STOKER_TOKEN", raising=False)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("pki")
    ca = Authority(folder)
    files = {}
    for name, token in (("a", A_TOKEN), ("ops", OPS_TOKEN), ("shared", SHARED_TOKEN)):
        files[name] = folder / f"{name}.token"
        files[name].write_text(token + "\n")
    return {"ca": ca.ca, "server": ca.issue("server", server=True),
            # a certificate the CA signed that no grant names: it passes mutual TLS only
            "anyone": ca.issue("anyone", server=False),
            "trainer-b": ca.issue("trainer-b", server=False), "tokens": files}


@pytest.fixture(scope="module")
def server(start_server_module, pki):
    tokens = pki["tokens"]
    return start_server_module(DATASETS, server={
        "tls": {"cert_file": str(pki["server"].cert), "key_file": str(pki["server"].key),
                "client_ca_file": str(pki["ca"])},
        "auth_token_file": str(tokens["shared"]),
        "grants": [
            {"name": "team-a", "token_file": str(tokens["a"]), "datasets": ["alpha"]},
            {"name": "team-b", "client_cert": "CN=trainer-b", "datasets": ["beta", "common"]},
            {"name": "ops", "token_file": str(tokens["ops"]), "datasets": ["*"],
             "operator": True}]},
        cache={"decoded_bytes": 16 << 20})


# Who is who: (the client certificate, the bearer token).
WHO = {"team-a": ("anyone", A_TOKEN), "team-b": ("trainer-b", None),
       "ops": ("anyone", OPS_TOKEN), "shared": ("anyone", SHARED_TOKEN),
       "nobody": ("anyone", None)}


def tls_of(pki: dict[str, Any], who: str) -> dict[str, str]:
    cert: Pair = pki[WHO[who][0]]
    return {"ca": str(pki["ca"]), "cert": str(cert.cert), "key": str(cert.key)}


def loader(server: Any, pki: dict[str, Any], who: str, dataset: str, **kw: Any
           ) -> RemoteLoader:
    kw = {"batch_size": 3, "output": "numpy", "timeout": 20, "shuffle": False, **kw}
    return RemoteLoader(server.address, dataset, tls=tls_of(pki, who), token=WHO[who][1], **kw)


def channel(server: Any, pki: dict[str, Any], who: str) -> grpc.Channel:
    cert: Pair = pki[WHO[who][0]]
    creds = grpc.ssl_channel_credentials(pki["ca"].read_bytes(), cert.key.read_bytes(),
                                         cert.cert.read_bytes())
    return grpc.secure_channel(server.address, creds)


def metadata(who: str) -> list[tuple[str, str]]:
    token = WHO[who][1]
    return [("authorization", f"Bearer {token}")] if token else []


def coords(dataset: str) -> pb.Coordinates:
    return pb.Coordinates(dataset=dataset, seed=0, epoch=0, shuffle=False, rank=0,
                          world_size=1, batch_size=3, drop_last=True)


def answers(server: Any, pki: dict[str, Any], who: str, request: pb.StreamRequest,
            got: list[pb.BatchFrame]) -> None:
    """Every frame of a raw StreamBatches call, into `got` (grpc.RpcError if it is refused)."""
    with channel(server, pki, who) as ch:
        call = ch.stream_stream(STREAM, request_serializer=pb.StreamRequest.SerializeToString,
                                response_deserializer=pb.BatchFrame.FromString)(
            iter([request]), timeout=20, metadata=metadata(who))
        for frame in call:
            got.append(frame)


def listed(server: Any, pki: dict[str, Any], who: str) -> list[str]:
    with channel(server, pki, who) as ch:
        reply = pb_grpc.DataServiceStub(ch).ListDatasets(pb.ListDatasetsRequest(),
                                                         metadata=metadata(who), timeout=20)
    return [d.name for d in reply.datasets]


# -- gRPC --------------------------------------------------------------------------------------
def test_each_credential_lists_only_its_own_datasets(server, pki, ledger) -> None:
    assert listed(server, pki, "team-a") == ["alpha"]
    assert listed(server, pki, "team-b") == ["beta", "common"]
    assert listed(server, pki, "ops") == ["alpha", "beta", "common"]
    assert listed(server, pki, "shared") == ["alpha", "beta", "common"]  # as before grants
    with pytest.raises(grpc.RpcError) as rpc:
        listed(server, pki, "nobody")  # a certificate the CA signed, but no grant names it
    assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "alpha" not in rpc.value.details()
    ledger.record("security", "grants: ListDatasets by each credential", tried=5,
                  detail="each sees only its grant's datasets; an ungranted certificate "
                         "UNAUTHENTICATED")


def test_another_grants_dataset_is_not_found_like_one_that_does_not_exist(
        server, pki, ledger) -> None:
    said = {}
    for name in ("beta", "common", "no-such-dataset"):
        with loader(server, pki, "team-a", name) as lo, pytest.raises(RemoteError) as err:
            lo.describe()
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        said[name] = str(err.value).replace(repr(name), "NAME")
        others = {"beta", "common"} - {name}
        assert not any(o in str(err.value) for o in others), str(err.value)
        assert "datasets: alpha" in str(err.value)
    # The same answer for a dataset served to others and for one that does not exist.
    assert said["beta"] == said["no-such-dataset"] == said["common"], said
    with loader(server, pki, "team-b", "alpha") as lo, pytest.raises(RemoteError) as err:
        lo.describe()
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "alpha" in str(err.value)
    assert "datasets: beta, common" in str(err.value)
    ledger.record("security", "grants: Describe of another grant's dataset", tried=4,
                  detail="NOT_FOUND as for an unknown name, naming only the caller's own")


@pytest.mark.parametrize("action", ["iterate", "batch_at", "seek", "provenance"])
def test_a_grant_cannot_read_seek_or_inspect_another_dataset(server, pki, ledger,
                                                             action: str) -> None:
    with pytest.raises(RemoteError) as err:
        with loader(server, pki, "team-a", "beta") as lo:
            if action == "iterate":
                next(iter(lo))
            elif action == "batch_at":
                lo.batch_at(0, 0)
            elif action == "seek":
                lo.seek(1)
                next(iter(lo))
            else:
                lo.provenance(0, 0)
    assert err.value.code == grpc.StatusCode.NOT_FOUND, (action, err.value)
    assert "common" not in str(err.value)
    # Provenance asked directly, without the client's describe first.
    with channel(server, pki, "team-a") as ch, pytest.raises(grpc.RpcError) as rpc:
        pb_grpc.DataServiceStub(ch).Provenance(pb.ProvenanceRequest(
            coordinates=coords("beta"), batch_index=0), metadata=metadata("team-a"),
            timeout=20)
    assert rpc.value.code() == grpc.StatusCode.NOT_FOUND
    ledger.record("security", f"grants: {action} of another grant's dataset", tried=2,
                  detail="NOT_FOUND before any sample is read")


def test_neither_cache_serves_another_grants_batches(server, pki, ledger) -> None:
    """team-b reads beta (its batches kept in the shared-batch cache, its samples' prepared
    form in the prefix cache); team-a asks for the very same coordinates at once, by frames
    and by shared memory: refused, no frame, no segment named."""
    with loader(server, pki, "team-b", "beta", shared_memory=False) as lo:
        own = [b["label"] for b in lo]
    assert len(own) == 4
    tried = 0
    for extra in ({}, {"shm_probe": probe()}, {"data_socket": True}):
        request = pb.StreamRequest(coordinates=coords("beta"), batch_indices=[0, 1], **extra)
        got: list[pb.BatchFrame] = []
        with pytest.raises(grpc.RpcError) as rpc:
            answers(server, pki, "team-a", request, got)
        assert rpc.value.code() == grpc.StatusCode.NOT_FOUND, extra
        # At most the data port's offer (it answers the request before its coordinates are
        # read, and its connection then gets nothing): no batch, no segment named.
        assert all(f.WhichOneof("kind") == "data_socket" for f in got), got
        assert not any(f.data or f.payload_bytes for f in got)
        tried += 1
    # Its own dataset, by shared memory: served.
    with loader(server, pki, "team-a", "alpha") as lo:
        got = [i for b in lo for i in b["sample_index"].tolist()]
        assert lo.stats()["transport"] == "shm"
    assert got == list(range(12))
    ledger.record("security", "grants: another grant's batches, just built and kept in the "
                  "shared-batch and prefix caches (frames, shared memory, data connection)",
                  tried=tried, detail="NOT_FOUND; no batch frame, no segment named")


# -- the data connection -----------------------------------------------------------------------
def _claim(server: Any, pki: dict[str, Any], cert: str, offer: pb.DataSocket, proof_key: str | None
           ) -> bytes:
    """What the data port sends back after a TLS claim of `offer` with `cert`'s certificate
    and the proof of `proof_key` (None: no proof), until it closes or 64 KiB came."""
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    context.load_cert_chain(pki[cert].cert, pki[cert].key)
    claim = bytes(offer.token)
    if proof_key is not None:
        claim += hmac.new(proof_key.encode(), claim, hashlib.sha256).digest()
    out = b""
    with context.wrap_socket(socket.create_connection(("127.0.0.1", offer.port), timeout=20),
                             server_hostname="localhost") as sock:
        sock.sendall(claim)
        try:
            while len(out) < 65536 and (more := sock.recv(65536)):
                out += more
        except (ConnectionResetError, ssl.SSLError, TimeoutError):
            pass
    return out


def test_the_data_connection_proves_the_streams_own_credential(server, pki, ledger) -> None:
    # team-a's offer: a claim proving another grant's token gets nothing; its own, the batch.
    for key, gets in ((OPS_TOKEN, False), (SHARED_TOKEN, False), (A_TOKEN, True)):
        with channel(server, pki, "team-a") as ch:
            call = ch.stream_stream(STREAM, request_serializer=pb.StreamRequest.SerializeToString,
                                    response_deserializer=pb.BatchFrame.FromString)(
                iter([pb.StreamRequest(coordinates=coords("alpha"), batch_indices=[0],
                                       data_socket=True)]), timeout=20,
                metadata=metadata("team-a"))
            offer = next(call).data_socket
            assert offer.proof
            assert (len(_claim(server, pki, "anyone", offer, key)) > 0) == gets, key
            call.cancel()
    # team-b's offer (granted by its certificate, no token): a connection with another
    # certificate the CA signed gets nothing, even with a token's proof; its own, the batch.
    for cert, key, gets in (("anyone", None, False), ("anyone", OPS_TOKEN, False),
                            ("trainer-b", None, True)):
        with channel(server, pki, "team-b") as ch:
            call = ch.stream_stream(STREAM, request_serializer=pb.StreamRequest.SerializeToString,
                                    response_deserializer=pb.BatchFrame.FromString)(
                iter([pb.StreamRequest(coordinates=coords("common"), batch_indices=[0],
                                       data_socket=True)]), timeout=20)
            offer = next(call).data_socket
            assert not offer.proof
            assert (len(_claim(server, pki, cert, offer, key)) > 0) == gets, (cert, key)
            call.cancel()
    # And the loader itself rides the data connection under its grant.
    with loader(server, pki, "team-b", "common", shared_memory=False) as lo:
        got = [i for b in lo for i in b["sample_index"].tolist()]
        assert lo.stats()["transport"] == "data_socket"
    assert got == list(range(12))
    ledger.record("security", "grants: a data-connection claim proving another credential "
                  "(another grant's token, another certificate)", tried=4,
                  detail="closed with nothing sent; the stream's own credential gets it")


# -- HTTP --------------------------------------------------------------------------------------
def http_get(server: Any, pki: dict[str, Any], who: str, path: str) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {WHO[who][1]}"} if WHO[who][1] else {}
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    cert: Pair = pki[WHO[who][0]]
    context.load_cert_chain(cert.cert, cert.key)
    request = urllib.request.Request(server.http_url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=20, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def test_operator_endpoints_refuse_non_operators(server, pki, ledger) -> None:
    with loader(server, pki, "team-a", "alpha") as lo:  # a stream of its, for /metrics below
        next(iter(lo))
    tried = 0
    for path in ("/v1/stats", "/v1/datasets", "/v1/datasets/alpha", "/v1/datasets/beta",
                 "/metrics", "/"):
        for who in ("team-a", "team-b"):
            status, body = http_get(server, pki, who, path)
            assert status == 403, (who, path, status)
            assert not any(d in body for d in DATASETS), body
            tried += 1
        status, _ = http_get(server, pki, "nobody", path)
        assert status == 401, path
        for who in ("ops", "shared"):
            assert http_get(server, pki, who, path)[0] == 200, (who, path)
        tried += 1
    for probe_path in ("/healthz", "/readyz"):
        assert http_get(server, pki, "nobody", probe_path)[0] == 200
    status, body = http_get(server, pki, "ops", "/v1/datasets")
    assert sorted(d["name"] for d in json.loads(body)) == ["alpha", "beta", "common"]
    status, body = http_get(server, pki, "ops", "/metrics")
    assert 'stoker_grant_streams_total{grant="team-a"}' in body
    assert A_TOKEN not in body and OPS_TOKEN not in body
    ledger.record("security", "grants: HTTP operator paths by non-operators and strangers",
                  tried=tried, detail="403 (a grant) or 401 (none), no dataset named; "
                                      "operators and the shared token get them")


def test_the_single_shared_token_still_opens_every_dataset(server, pki) -> None:
    for name in DATASETS:
        with loader(server, pki, "shared", name) as lo:
            assert sum(len(b["sample_index"]) for b in lo) == 12


# -- config and paths --------------------------------------------------------------------------
def _config_error(tmp_path: Path, server: dict[str, Any]) -> str:
    (tmp_path / "t.token").write_text(A_TOKEN)
    path = write_config(tmp_path / "c.yaml", {"server": server, "datasets": {"alpha": NOISE}})
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return str(err.value)


def test_bad_grants_stop_the_start_naming_the_field(tmp_path: Path) -> None:
    said = _config_error(tmp_path, {"grants": [{"name": "x", "token_file": "t.token",
                                                "datasets": ["nope"]}]})
    assert "server.grants.0.datasets" in said and "nope" in said
    said = _config_error(tmp_path, {"grants": [{"name": "x", "token_file": "t.token",
                                                "client_cert": "CN=x", "datasets": ["*"]}]})
    assert "server.grants.0" in said and "one credential" in said
    said = _config_error(tmp_path, {"grants": [{"name": "x", "client_cert": "CN=x",
                                                "datasets": ["*"]}]})
    assert "mutual TLS" in said
    said = _config_error(tmp_path, {"grants": [{"name": "x", "token_file": "t.token",
                                                "datasets": ["*"], "tokn": 1}]})
    assert "tokn" in said


def test_redact_paths_keeps_server_paths_out_of_client_errors(start_server) -> None:
    leaky = {"leaky": {"format": "python", "factory": "grant_datasets:Leaky"}}
    server = start_server(leaky, server={"redact_paths": True})
    with RemoteLoader(server.address, "leaky", batch_size=2, shuffle=False, output="numpy",
                      timeout=20) as lo, pytest.raises(RemoteError) as err:
        list(lo)
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert "/srv/team-secret" not in str(err.value), str(err.value)
    assert ".../shard-00004.bin" in str(err.value), str(err.value)
    assert "/srv/team-secret" in server.stderr  # the operator's log keeps it


def test_redact_cuts_paths_and_urls_to_their_last_part() -> None:
    assert redact("sample 3 of /data/a/b.jpg: bad") == "sample 3 of .../b.jpg: bad"
    assert redact("s3://bucket/p/q.tar line 2") == ".../q.tar line 2"
    assert redact("ratio 3/4, /x alone") == "ratio 3/4, /x alone"


def test_a_server_started_with_grants_says_auth_in_its_ready_line(tmp_path: Path, pki) -> None:
    (tmp_path / "a.token").write_text(A_TOKEN)
    config = write_config(tmp_path / "c.yaml", {"server": {"grants": [
        {"name": "team-a", "token_file": "a.token", "datasets": ["alpha"]}]},
        "datasets": {"alpha": NOISE, "common": NOISE}})
    with ServerProcess(config, workers=1, env=server_env()) as proc:
        assert proc.ready["auth"]
        with RemoteLoader(proc.address, "alpha", batch_size=3, token=A_TOKEN,
                          output="numpy", timeout=20) as lo:
            assert sorted(np.concatenate([b["sample_index"] for b in lo]).tolist()) == list(
                range(12))
        with pytest.raises(RemoteError) as err:
            RemoteLoader(proc.address, "alpha", batch_size=3, timeout=5).describe()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
