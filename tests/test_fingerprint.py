"""Data that drifts under a running server is never served as something else.

A dataset's fingerprint (its config and its listing: keys, sizes, mtimes or ETags) is taken when
the server opens it; a worker that lists other data is refused, a file that changed since the
listing fails its samples, and a stream or Describe that expects another fingerprint is
refused. Issue 19, failure 1 and "a jsonl file rewritten in place".
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import tarfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from epochs import epoch
from PIL import Image

from stoker.client import DataMismatch, RemoteError, RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import stoker_pb2_grpc as pb_grpc

import s3_endpoint as s3
from conftest import server_env
from s3_endpoint import moto_endpoint_fixture  # noqa: F401  (the moto_endpoint fixture)

pytestmark = pytest.mark.timeout(60)

CLASSES = "bcdef"  # 8 images each: 40; "aaa" sorts before all of them


def png_bytes(rgb: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), rgb).save(out, format="PNG")
    return out.getvalue()


def add_class(root: Path, name: str, n: int = 8) -> None:
    (root / name).mkdir(parents=True)
    for i in range(n):
        (root / name / f"{i}.png").write_bytes(png_bytes((i * 30, ord(name[0]), 7)))


@pytest.fixture
def images(tmp_path: Path) -> Path:
    root = tmp_path / "imgs"
    for c in CLASSES:
        add_class(root, c)
    return root


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `check` until true (bounded): for events only a log line shows."""
    deadline, pause = time.monotonic() + timeout, threading.Event()
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        pause.wait(0.05)


def worker_pids(server: ServerProcess) -> list[int]:
    """The server's worker processes (spawned children, the resource tracker aside)."""
    assert server.proc is not None
    pids = []
    for children in Path(f"/proc/{server.proc.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            # Named `stoker worker N ...` once started; spawn_main before.
            if ((b"spawn_main" in cmd and b"resource_tracker" not in cmd)
                    or cmd.startswith(b"stoker worker")):
                pids.append(int(pid))
    return sorted(pids)


def image_bytes(server: ServerProcess, dataset: str) -> list[tuple[int, bytes]]:
    """One epoch: (sample index, the image's bytes) per sample, in order."""
    return [(int(i), image.tobytes()) for b in epoch(server, dataset, batch_size=4, seed=5,
                                                     timeout=30)
            for i, image in zip(b["sample_index"], b["image"], strict=True)]


def http_status(server: ServerProcess, path: str) -> int:
    try:
        with urllib.request.urlopen(server.http_url + path, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def coordinates(dataset: str, fingerprint: str = "") -> pb.Coordinates:
    return pb.Coordinates(dataset=dataset, world_size=1, batch_size=4, fingerprint=fingerprint)


# -- failure 1: a restarted worker re-lists a changed folder ------------------------------------

def test_a_replacement_worker_that_lists_new_files_is_refused(start_server, images: Path,
                                                              ledger) -> None:
    server = start_server({"imgs": {"format": "image-folder", "source": str(images),
                                    "size": 8}}, workers=2)
    first = image_bytes(server, "imgs")
    assert len(first) == 40
    add_class(images, "aaa")  # sorts first: a re-listing would move every index
    os.kill(worker_pids(server)[0], signal.SIGKILL)
    wait_for(lambda: "refused" in server.stderr or "sees other data" in server.stderr, 30,
             "the replacement worker's refusal in the log")
    log = server.stderr
    assert "dataset 'imgs'" in log and "40 objects" in log and "48 objects" in log, log
    assert "added 'aaa/' (8 objects)" in log and "restart the server" in log, log
    assert "Traceback" not in log, log
    second = image_bytes(server, "imgs")
    lost, dup = ledger.compare(second, first)
    ledger.record("storage", "class folder added, then a worker killed: its replacement's "
                  "new listing refused", lost=lost, duplicated=dup,
                  detail="the next epoch is byte-identical to the first")
    assert second == first  # byte for byte, in the same order
    assert http_status(server, "/readyz") == 200  # one worker still serves


def test_with_no_worker_left_batches_fail_unavailable_naming_the_refusal(
        start_server, images: Path, ledger) -> None:
    server = start_server({"imgs": {"format": "image-folder", "source": str(images),
                                    "size": 8}}, workers=1)
    add_class(images, "aaa")
    os.kill(worker_pids(server)[0], signal.SIGKILL)
    wait_for(lambda: "sees other data" in server.stderr, 30, "the refusal in the log")
    with grpc.insecure_channel(server.address) as channel:
        call = pb_grpc.DataServiceStub(channel).StreamBatches(iter([pb.StreamRequest(
            coordinates=coordinates("imgs"), batch_indices=[0])]), timeout=30)
        frames = list(call)
    errors = [f.error for f in frames if f.HasField("error")]
    assert [e.code for e in errors] == [grpc.StatusCode.UNAVAILABLE.value[0]], frames
    assert "sees other data" in errors[0].message and "restart the server" in errors[0].message
    assert "48 objects" in errors[0].message
    wait_for(lambda: http_status(server, "/readyz") == 503, 10, "/readyz 503")
    ledger.record("storage", "the only worker's replacement refused (data changed): "
                  "UNAVAILABLE in-band, /readyz 503", detail="no batch of the new listing")


def test_workers_that_see_different_data_at_start_stop_the_start(tmp_path: Path,
                                                                 ledger) -> None:
    config = write_config(tmp_path / "c.yaml", {"datasets": {"drift": {
        "format": "python", "factory": "drift_datasets:Versioned",
        "options": {"per_process": True}}}})
    server = ServerProcess(config, workers=2, env=server_env())
    with pytest.raises(RuntimeError) as info:
        server.start()
    said = str(info.value)
    assert "dataset 'drift': the data changed while the server started" in said, said
    assert "worker 0 has sha256:" in said and "worker 1 has sha256:" in said, said
    assert "Traceback" not in said
    ledger.record("storage", "workers listing different data at start: start refused")


# -- the fingerprint served, and checked --------------------------------------------------------

def test_describe_list_and_http_carry_the_fingerprint_and_a_stream_says_it(
        start_server, images: Path) -> None:
    server = start_server({"imgs": {"format": "image-folder", "source": str(images),
                                    "size": 8},
                           "smaller": {"format": "image-folder", "source": str(images),
                                       "size": 4}})
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.DataServiceStub(channel)
        described = stub.DescribeDataset(pb.DescribeDatasetRequest(
            coordinates=coordinates("imgs")), timeout=30).fingerprint
        assert described.digest.startswith("sha256:") and len(described.digest) == 71
        assert described.objects == 40 and described.bytes == sum(
            p.stat().st_size for p in images.rglob("*.png"))
        listed = {d.name: d.fingerprint for d in stub.ListDatasets(
            pb.ListDatasetsRequest(), timeout=30).datasets}
        assert listed["imgs"] == described
        assert listed["smaller"].digest != described.digest  # the config counts
        with urllib.request.urlopen(server.http_url + "/v1/datasets", timeout=10) as r:
            http = {d["name"]: d["fingerprint"] for d in json.load(r)}
        assert http["imgs"] == {"digest": described.digest, "objects": 40,
                                "bytes": described.bytes}
        # Accepted: the stream's initial metadata names the digest.
        call = stub.StreamBatches(iter([pb.StreamRequest(
            coordinates=coordinates("imgs", described.digest), batch_indices=[0])]),
            timeout=30)
        assert ("stoker-fingerprint", described.digest) in tuple(call.initial_metadata())
        assert len(list(call)) >= 1


def test_a_stream_or_describe_expecting_other_data_is_refused(start_server,
                                                              images: Path, ledger) -> None:
    server = start_server({"imgs": {"format": "image-folder", "source": str(images),
                                    "size": 8}})
    other = "sha256:" + "ab" * 32
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.DataServiceStub(channel)
        digest = stub.DescribeDataset(pb.DescribeDatasetRequest(
            coordinates=coordinates("imgs")), timeout=30).fingerprint.digest
        with pytest.raises(grpc.RpcError) as described:
            stub.DescribeDataset(pb.DescribeDatasetRequest(
                coordinates=coordinates("imgs", other)), timeout=30)
        call = stub.StreamBatches(iter([pb.StreamRequest(
            coordinates=coordinates("imgs", other), batch_indices=[0, 1])]), timeout=30)
        with pytest.raises(grpc.RpcError) as streamed:
            frames = list(call)
            raise AssertionError(f"served {len(frames)} frames")
    for err in (described.value, streamed.value):
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        said = err.details()
        assert "dataset 'imgs'" in said and digest[:19] in said and other[:19] in said
        assert "40 objects" in said
        assert ("stoker-fingerprint", digest) in tuple(err.trailing_metadata())
    ledger.record("bad requests", "a stream and a Describe expecting another fingerprint",
                  tried=2, detail="FAILED_PRECONDITION with the server's digest")


# -- files that change after listing -------------------------------------------------------------

def _touch_in_place(path: Path, offset: int | None = None, data: bytes | None = None) -> None:
    """Rewrite bytes of `path` in place (same size; the mtime moves)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        at = size // 2 if offset is None else offset
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(data if data is not None else old)


def test_files_changed_after_listing_fail_their_samples(tmp_path: Path, ledger) -> None:
    """Every format that reads local files: a file rewritten in place (same size, new mtime)
    fails its samples with DATA_LOSS naming it relative to the root; nothing of its new
    bytes is served, and `on_error: skip` does not replace them silently."""
    root = tmp_path / "data"
    for d in ("jsonl", "tokens", "memmap", "tar", "parquet"):
        (root / d).mkdir(parents=True)
    add_class(root / "images", "cats")
    (root / "jsonl" / "x.jsonl").write_text("".join(
        json.dumps({"v": 1000 + i}) + "\n" for i in range(8)))
    (root / "tokens" / "a.bin").write_bytes(np.arange(64, dtype="<u2").tobytes())
    np.save(root / "memmap" / "x.npy", np.arange(16, dtype=np.float32).reshape(8, 2))
    with tarfile.open(root / "tar" / "s.tar", "w") as tf:
        for i in range(8):
            data = str(i).encode()
            info = tarfile.TarInfo(f"{i:03d}.cls")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    pq.write_table(pa.table({"x": list(range(8))}), root / "parquet" / "p.parquet")
    datasets = {
        "jsonl": {"format": "jsonl", "source": str(root / "jsonl"),
                  "fields": {"v": {"dtype": "int64"}}},
        "skipping": {"format": "jsonl", "source": str(root / "jsonl"), "on_error": "skip",
                     "fields": {"v": {"dtype": "int64"}}},
        "tokens": {"format": "tokens", "source": str(root / "tokens"), "seq_len": 4},
        "memmap": {"format": "memmap", "source": str(root / "memmap"),
                   "fields": {"x": "*.npy"}},
        "tar": {"format": "tar", "source": str(root / "tar"),
                "fields": {"label": {"ext": "cls", "decode": "int"}}},
        "parquet": {"format": "parquet", "source": str(root / "parquet"), "fields": {"x": {}}},
        "images": {"format": "image-folder", "source": str(root / "images"), "size": 4},
    }
    changed = {"jsonl": "x.jsonl", "skipping": "x.jsonl", "tokens": "a.bin",
               "memmap": "x.npy", "tar": "s.tar", "parquet": "p.parquet",
               "images": "cats/3.png"}
    # shared_batches 0: each read goes to the files (batches kept for other jobs would serve
    # the bytes as listed, which is right, but not what this test is about)
    config = write_config(tmp_path / "c.yaml", {"cache": {"shared_batches": 0},
                                                "datasets": datasets})

    def first_epoch(server: ServerProcess, name: str) -> list[Any]:
        with RemoteLoader(server.address, name, batch_size=2, shuffle=False, output="numpy",
                          timeout=30) as loader:
            return [b for b in loader]

    with ServerProcess(config, workers=1, env=server_env()) as server:
        for name in datasets:
            assert first_epoch(server, name)  # all well before the change
        # New digits, same length: what a rewrite in place looks like.
        text = (root / "jsonl" / "x.jsonl").read_text().replace('"v": 10', '"v": 20')
        (root / "jsonl" / "x.jsonl").write_text(text)
        for name in ("tokens", "memmap", "tar", "parquet"):
            _touch_in_place(root / name / changed[name])
        (root / "images" / "cats" / "3.png").write_bytes(png_bytes((1, 2, 3)))
        for name, key in changed.items():
            served: list[Any] = []
            with pytest.raises(RemoteError) as info:
                with RemoteLoader(server.address, name, batch_size=2, shuffle=False,
                                  output="numpy", timeout=30) as loader:
                    served.extend(loader)
            said = info.value.details
            assert info.value.code == grpc.StatusCode.DATA_LOSS, (name, said)
            assert f"{key}: changed since the server listed it" in said, (name, said)
            assert "restart the server" in said, (name, said)
            if name in ("jsonl", "skipping"):  # the new values are never served
                assert not any((b["v"] >= 2000).any() for b in served), name
            ledger.record("storage", f"{name}: a file rewritten in place after listing",
                          detail="DATA_LOSS naming it; nothing of the new bytes served")


def test_an_s3_object_overwritten_after_listing_fails_its_samples(
        moto_endpoint: s3.MotoServer, tmp_path: Path, ledger) -> None:
    client = s3.s3_client(moto_endpoint.url)
    bucket = s3.new_bucket(client)
    s3.put_objects(client, bucket, {f"pics/c/{i}.png": png_bytes((i, 9, 9)) for i in range(8)})
    config = write_config(tmp_path / "c.yaml", {
        "s3": {"endpoint_url": moto_endpoint.url, "region": "us-east-1"},
        "cache": {"dir": str(tmp_path / "cache")},
        "datasets": {"remote": {"format": "image-folder", "source": f"s3://{bucket}/pics",
                                "size": 4}}})
    with ServerProcess(config, workers=1, env={**server_env(), **s3.s3_env()}) as server:
        # Listed (and sample 0 read) at start; overwritten before anything else is read.
        client.put_object(Bucket=bucket, Key="pics/c/5.png", Body=png_bytes((200, 0, 0)))
        with pytest.raises(RemoteError) as info:
            with RemoteLoader(server.address, "remote", batch_size=2, shuffle=False,
                              output="numpy", timeout=30) as loader:
                list(loader)
    said = info.value.details
    assert info.value.code == grpc.StatusCode.DATA_LOSS, said
    assert "c/5.png: overwritten since the server listed it" in said, said
    ledger.record("storage", "S3 object overwritten after listing (If-Match: 412)",
                  detail="DATA_LOSS naming it; nothing of the new bytes served")


# -- failure 2: a client given servers that listed the data at different times -----------------

@pytest.mark.parametrize("stale_first", [True, False])
def test_a_loader_refuses_to_mix_servers_with_different_data(start_server, images: Path,
                                                             ledger, stale_first: bool) -> None:
    dataset = {"imgs": {"format": "image-folder", "source": str(images), "size": 8}}
    stale = start_server(dataset)  # 40 images
    add_class(images, "aaa")
    fresh = start_server(dataset)  # 48
    order = [stale, fresh] if stale_first else [fresh, stale]
    served: list[Any] = []
    with pytest.raises(DataMismatch) as info:
        with RemoteLoader([s.address for s in order], "imgs", batch_size=4, output="numpy",
                          timeout=30) as loader:
            served.extend(loader)
    said = str(info.value)
    assert stale.address in said and fresh.address in said, said
    assert "40 objects" in said and "48 objects" in said and "must not mix" in said, said
    assert served == []  # refused before any batch is used
    assert isinstance(info.value, RemoteError)
    ledger.record("servers", "two servers listing a folder before and after 8 images came "
                  f"({'stale' if stale_first else 'fresh'} one first)", lost=0, duplicated=0,
                  detail="DataMismatch naming both before any batch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_with_other_data_that_comes_up_later_refuses_the_stream(
        start_server, tmp_path: Path, ledger) -> None:
    """The backstop: a server that was down when the loader compared fingerprints refuses
    its streams when it comes up, and the loader raises DataMismatch instead of using it."""
    def dataset(version: int) -> dict[str, Any]:
        return {"v": {"format": "python", "factory": "drift_datasets:Versioned",
                      "options": {"n": 400, "version": version, "delay": 0.001}}}

    pinned = start_server(dataset(1))
    later_port = free_port()
    later = ServerProcess(write_config(tmp_path / "later.yaml", {"datasets": dataset(2)}),
                          workers=1, port=later_port, env=server_env())
    versions: list[int] = []
    try:
        with RemoteLoader([pinned.address, f"127.0.0.1:{later_port}"], "v", batch_size=4,
                          output="numpy", timeout=30) as loader:
            for batch in loader:  # the other server is down: compared with nothing
                versions += batch["version"].tolist()
            later.start()
            # A server that failed is tried again after a backoff of at most a few seconds,
            # whatever the epochs do meanwhile: an epoch of this data can take 0.2 s, so the
            # loop is bounded by time, not by a count of epochs.
            deadline = time.monotonic() + 20
            with pytest.raises(DataMismatch) as info:
                while time.monotonic() < deadline:
                    for batch in loader:
                        versions += batch["version"].tolist()
        said = str(info.value)
        assert pinned.address in said and f"127.0.0.1:{later_port}" in said, said
        assert "must not mix" in said, said
        assert set(versions) == {1}, "a batch of the other data was used"
    finally:
        assert later.proc is None or later.stop() == 0
    ledger.record("servers", "a server with other data comes up after the loader started",
                  detail=f"its stream refused at the handshake after {len(versions)} samples "
                         "from the pinned server; none of its batches used")


# -- the parts, alone ---------------------------------------------------------------------------

def test_a_listing_keeps_what_it_saw_first_and_the_fingerprint_says_what_differs() -> None:
    from stoker.server._config import Config
    from stoker.server.order.fingerprint import of_listing
    from stoker.server.sources import ObjectInfo
    from stoker.server.sources._listing import RECENT, Listing

    listing = Listing()
    listing.update([ObjectInfo("b/1.png", 10, "t1"), ObjectInfo("é/2.png", 20, "t2")])
    listing.update([ObjectInfo("b/1.png", 11, "t9"), ObjectInfo("c/3.png", 30, "t3")])
    assert listing.add(ObjectInfo("c/3.png", 31, "t8")).version == "t3"
    for i in range(RECENT + 1):  # added one by one, then compacted
        listing.add(ObjectInfo(f"d/{i:05d}.png", 1, "t"))
    assert listing.get("b/1.png") == ObjectInfo("b/1.png", 10, "t1")
    assert listing.get("é/2.png") == ObjectInfo("é/2.png", 20, "t2") and "x" not in listing
    got = list(listing.values())
    assert len(got) == len(listing) == RECENT + 4 and got == sorted(got, key=lambda o: o.key)

    cfg = Config.model_validate({"datasets": {"d": {
        "format": "jsonl", "source": str(Path(__file__).parent), "s3": {"region": "x"},
        "fields": {"v": {}}}}}).datasets["d"]
    old = of_listing(cfg, [ObjectInfo("b/1.png", 10, "t1"), ObjectInfo("c/3.png", 30, "t3")])
    new = of_listing(cfg, [ObjectInfo("aaa/0.png", 5, "t5"), ObjectInfo("b/1.png", 10, "t2"),
                           ObjectInfo("c/3.png", 30, "t3")])
    assert old != new and (old.objects, old.bytes, new.objects) == (2, 40, 3)
    assert old.changes(new) == "added 'aaa/' (1 object); changed 'b/'"
    assert old.short().startswith("sha256:") and "(2 objects, 40 bytes)" in old.short()
    # Where the data lies and how to reach it are no part of it; what it is, is.
    moved = cfg.model_copy(update={"source": "/elsewhere", "s3": None})
    assert of_listing(moved, [ObjectInfo("b/1.png", 10, "t1"),
                              ObjectInfo("c/3.png", 30, "t3")]) == old
    skipping = cfg.model_copy(update={"on_error": "skip"})
    assert of_listing(skipping, [ObjectInfo("b/1.png", 10, "t1"),
                                 ObjectInfo("c/3.png", 30, "t3")]) != old
