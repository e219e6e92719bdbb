"""Storage that degrades rather than fails: a read-only or full disk cache is read past for every
format, an S3 outage is UNAVAILABLE (another server serves the batch), and what a client is told
names files relative to the dataset's root, never where the server keeps them.

Real server processes against the session's moto S3 endpoint (tests/s3_endpoint.py). A read-only
cache is a small tmpfs remounted read-only (root only: the tests skip where mount fails; chmod is
no test, since root writes anyway)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from epochs import epoch
from PIL import Image
from test_s3_faults import metrics_of

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess, write_config

from conftest import server_env
from s3_endpoint import (
    MotoServer,
    moto_endpoint_fixture,  # noqa: F401  (the moto_endpoint fixture)
    new_bucket,
    put_objects,
    s3_client,
    s3_env,
)

pytest.importorskip("stoker.server.sources.s3")
pytestmark = pytest.mark.timeout(90)

KiB = 1 << 10
IMAGE_FIELDS = {"image": {"ext": "png", "decode": "image", "size": 4},
                "label": {"ext": "cls", "decode": "int"}}


# -- data: one corpus in three formats, on local disk and in a bucket --------------------------

def _png(rng: np.random.Generator, side: int) -> bytes:
    out = io.BytesIO()  # noise: incompressible, about side*side*3 bytes
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


def corpus(root: Path) -> dict[str, bytes]:
    """pics/ (image folder, 24 PNGs), jsonl/ (3 files), tar/ (3 shards): about 1.5 MiB, each
    format well over half a MiB. Written under `root`; returns key -> bytes for the bucket."""
    rng = np.random.default_rng(19)
    files: dict[str, bytes] = {}
    for c in ("a", "b", "c"):
        for i in range(8):
            files[f"pics/{c}/{i}.png"] = _png(rng, 60)
    for f in range(3):
        rows = [json.dumps({"x": 100 * f + i, "v": [f, i, f * i], "pad": "p" * 4000}) + "\n"
                for i in range(50)]
        files[f"jsonl/{f}.jsonl"] = "".join(rows).encode()
    for s in range(3):
        members = []
        for i in range(16):
            members += [(f"{s}{i:03d}.png", _png(rng, 64)), (f"{s}{i:03d}.cls", str(i).encode())]
        files[f"tar/{s}.tar"] = _tar(members)
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return files


FORMATS = {"pics": {"format": "image-folder", "size": 4},
           "jsonl": {"format": "jsonl", "fields": {"x": {}, "v": {"shape": [3]}}},
           "tar": {"format": "tar", "fields": IMAGE_FIELDS}}


@pytest.fixture(scope="module")
def data(moto_endpoint: MotoServer, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, Any]:
    local = tmp_path_factory.mktemp("local")
    files = corpus(local)
    bucket = new_bucket(s3_client(moto_endpoint.url))
    put_objects(s3_client(moto_endpoint.url), bucket, files)
    return {"local": local, "bucket": bucket, "endpoint": moto_endpoint.url,
            "objects": len(files)}


def config(path: Path, data: dict[str, Any], cache: Path, endpoint: str | None = None,
           **dataset: Any) -> Path:
    """Each format twice: `remote-NAME` from the bucket, `local-NAME` from the local copy."""
    datasets = {}
    for name, cfg in FORMATS.items():
        datasets[f"remote-{name}"] = {**cfg, **dataset,
                                      "source": f"s3://{data['bucket']}/{name}"}
        datasets[f"local-{name}"] = {**cfg, **dataset, "source": str(data["local"] / name)}
    return write_config(path, {
        "s3": {"endpoint_url": endpoint or data["endpoint"], "region": "us-east-1"},
        "cache": {"dir": str(cache), "max_bytes": "64MiB", "prefetch_bytes": "1MiB"},
        "datasets": datasets})


READ = {"batch_size": 4, "seed": 7, "drop_last": False}  # every epoch() here


def compare(ledger: Any, server: ServerProcess, case: str) -> None:
    """Every format's S3 epoch equals its local copy's, batch for batch; one ledger row."""
    lost = dup = 0
    for name in FORMATS:
        got, want = (epoch(server.address, f"remote-{name}", **READ),
                     epoch(server.address, f"local-{name}", **READ))
        indices = [int(i) for b in got for i in b["sample_index"]]
        expected = [int(i) for b in want for i in b["sample_index"]]
        n_lost, n_dup = ledger.compare(indices, expected)
        lost, dup = lost + n_lost, dup + n_dup
        assert len(got) == len(want), name
        for g, w in zip(got, want, strict=True):
            assert g.keys() == w.keys(), name
            for field in w:
                np.testing.assert_array_equal(g[field], w[field], err_msg=f"{name}.{field}")
    ledger.record("storage", case, tried=len(FORMATS), lost=lost, duplicated=dup,
                  detail="image-folder, jsonl and tar epochs from S3 equal the local copies")
    assert lost == dup == 0


# -- a cache folder on a small tmpfs -------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """tmpfs(size) -> a fresh tmpfs of that size (root only: mount); unmounted afterwards."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk-{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"mounting a tmpfs needs root: {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=True)


def read_only(where: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
    with pytest.raises(OSError, match="Read-only"):
        (where / "probe").write_bytes(b"x")


def start(path: Path, workers: int = 1) -> ServerProcess:
    return ServerProcess(path, workers=workers, env={**server_env(), **s3_env()}).start()


def warnings_about(stderr: str, cache: Path) -> list[str]:
    return [line for line in stderr.splitlines() if f"disk cache {cache}:" in line]


def test_an_empty_read_only_cache_serves_every_format_with_one_warning(
        data: dict[str, Any], tmpfs: Callable[[str], Path], tmp_path: Path, ledger) -> None:
    cache = tmpfs("8m")
    read_only(cache)
    server = start(config(tmp_path / "c.yaml", data, cache))
    try:
        compare(ledger, server, "an empty S3 disk cache on a read-only disk")
        stats = metrics_of(server)
    finally:
        assert server.stop() == 0, server.stderr
    said = warnings_about(server.stderr, cache)
    assert len(said) == 1, server.stderr  # one worker: one warning
    assert "Read-only file system" in said[0] and "cache.dir" in said[0]
    assert "Traceback" not in server.stderr, server.stderr
    assert stats["stoker_cache_misses_total"] >= data["objects"]
    assert not any(cache.iterdir())


def test_a_read_only_cache_in_one_process(tmpfs: Callable[[str], Path], ledger) -> None:
    from stoker.server.sources.cache import DiskCache

    folder = tmpfs("1m")
    read_only(folder)
    cache = DiskCache(folder, 1 << 20)  # no error: the folder cannot even hold .locks
    fetched: list[str] = []

    def fetch(name: str) -> Callable[[int], None]:
        return lambda fd: fetched.append(name) or os.write(fd, name.encode() * 1000)

    path = cache.get("s3://b/shard.tar", "v1", fetch("shard"))
    assert path.read_bytes() == b"shard" * 1000 and not path.is_relative_to(folder)
    # A format reopens the path it got (memory maps): the same memory file, not fetched again.
    assert cache.get("s3://b/shard.tar", "v1", fetch("shard")) == path
    assert cache.read("s3://b/shard.tar", "v1", fetch("shard")) == b"shard" * 1000
    # Objects read whole are not kept: each read fetches.
    for _ in range(2):
        assert cache.read("s3://b/img.png", "v1", fetch("img")) == b"img" * 1000
    assert fetched == ["shard", "img", "img"]
    assert (cache.hits, cache.misses) == (2, 3)
    assert cache.degraded and not cache.writable
    assert not any(folder.iterdir())
    ledger.record("storage", "DiskCache on a read-only folder, in one process", tried=5,
                  detail="get() hands out memory files, kept for reuse; read() keeps nothing")


def test_a_filled_cache_made_read_only_still_hits(
        data: dict[str, Any], tmpfs: Callable[[str], Path], tmp_path: Path, ledger) -> None:
    cache = tmpfs("8m")
    path = config(tmp_path / "c.yaml", data, cache)
    server = start(path)
    try:
        for name in FORMATS:
            epoch(server.address, f"remote-{name}", **READ)  # fills the cache
    finally:
        assert server.stop() == 0, server.stderr
    read_only(cache)  # as ext4 does after a disk error
    server = start(path)
    try:
        compare(ledger, server, "a filled S3 disk cache remounted read-only")
        stats = metrics_of(server)
    finally:
        assert server.stop() == 0, server.stderr
    # Every object came from the cache: hits, and nothing fetched again.
    assert stats["stoker_cache_misses_total"] == 0, stats
    assert stats["stoker_cache_hits_total"] >= data["objects"], stats
    assert len(warnings_about(server.stderr, cache)) == 1, server.stderr
    assert "Traceback" not in server.stderr, server.stderr


def test_a_full_cache_disk_serves_every_format(
        data: dict[str, Any], tmpfs: Callable[[str], Path], tmp_path: Path, ledger) -> None:
    cache = tmpfs("512k")  # the corpus is 1.5 MiB: the disk fills before the cache evicts
    server = start(config(tmp_path / "c.yaml", data, cache), workers=2)
    try:
        compare(ledger, server, "the S3 disk cache's disk full (512 KiB tmpfs, 1.5 MiB of "
                "image-folder, jsonl and tar)")
    finally:
        assert server.stop() == 0, server.stderr
    said = warnings_about(server.stderr, cache)
    assert 1 <= len(said) <= 2 and "No space left on device" in said[0], server.stderr


# -- an S3 outage: UNAVAILABLE, and another server serves ------------------------------------

def test_an_s3_outage_on_one_server_costs_nothing_with_two(
        data: dict[str, Any], tmp_path: Path, ledger) -> None:
    from tcp_proxy import TcpProxy

    with TcpProxy(data["endpoint"].removeprefix("http://")) as proxy:
        # on_error: skip must not skip an outage: the samples are fine, the path to them isn't.
        broken = write_config(tmp_path / "broken.yaml", {
            "s3": {"endpoint_url": f"http://{proxy.address}", "region": "us-east-1",
                   "max_attempts": 2, "connect_timeout": 0.5, "read_timeout": 0.5},
            "cache": {"dir": str(tmp_path / "cache-a"), "prefetch_bytes": 0},
            "datasets": {"pics": {**FORMATS["pics"], "on_error": "skip",
                                  "source": f"s3://{data['bucket']}/pics"}}})
        healthy = write_config(tmp_path / "healthy.yaml", {
            "s3": {"endpoint_url": data["endpoint"], "region": "us-east-1"},
            "cache": {"dir": str(tmp_path / "cache-b"), "prefetch_bytes": 0},
            "datasets": {"pics": {**FORMATS["pics"], "on_error": "skip",
                                  "source": f"s3://{data['bucket']}/pics"},
                         "local": {**FORMATS["pics"], "on_error": "skip",
                                   "source": str(data["local"] / "pics")}}})
        a, b = start(broken), start(healthy)
        try:
            proxy.set("drop")  # after a's start: it listed the bucket and read sample 0
            got = epoch([a.address, b.address], "pics", **READ)
            want = epoch(b.address, "local", **READ)
        finally:
            assert a.stop() == 0, a.stderr
            assert b.stop() == 0, b.stderr
    indices = [int(i) for x in got for i in x["sample_index"]]
    lost, dup = ledger.compare(indices, [int(i) for x in want for i in x["sample_index"]])
    ledger.record("storage", "one of two servers loses its path to S3 for good (on_error: skip)",
                  lost=lost, duplicated=dup, detail="its batches answered UNAVAILABLE, never "
                  "skipped; the other server's epoch equals the local copy's")
    assert lost == dup == 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g["image"], w["image"])
    assert proxy.refused or "EndpointConnectionError" in a.stderr  # a really was cut off
    assert "skipping" not in a.stderr, a.stderr


# -- what a client is told: paths relative to the dataset's root ---------------------------

def _bad_inputs(root: Path) -> dict[str, bytes]:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    rng = np.random.default_rng(3)
    files = {"img/a/0.png": _png(rng, 8), "img/a/1.png": b"\x89PNG\r\n\x1a\n not an image",
             "rec/r.jsonl": b'{"x": 1}\n{"x": 2}\n{"x": oops}\n'}
    out = io.BytesIO()
    # No statistics: a null they count would stop the start instead of failing a sample.
    pq.write_table(pa.table({"x": pa.array([1, 2, None, 4], pa.int64())}), out,
                   write_statistics=False)
    files["table/t.parquet"] = out.getvalue()
    for key, body in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(body)
    return files


def test_data_loss_names_files_relative_to_the_dataset_root(
        moto_endpoint: MotoServer, tmp_path: Path, ledger) -> None:
    local = tmp_path / "inputs"
    bucket = new_bucket(s3_client(moto_endpoint.url))
    put_objects(s3_client(moto_endpoint.url), bucket, {f"in/{k}": v for k, v in
                                                       _bad_inputs(local).items()})
    cache = tmp_path / "cache"
    kinds = {"img": ({"format": "image-folder", "size": 4}, "a/1.png"),
             "rec": ({"format": "jsonl", "fields": {"x": {}}}, "r.jsonl line 3"),
             "table": ({"format": "parquet", "fields": {"x": {}}}, "t.parquet row group 0")}
    datasets = {}
    for name, (cfg, _) in kinds.items():
        datasets[f"local-{name}"] = {**cfg, "source": str(local / name)}
        datasets[f"remote-{name}"] = {**cfg, "source": f"s3://{bucket}/in/{name}"}
    path = write_config(tmp_path / "c.yaml", {
        "s3": {"endpoint_url": moto_endpoint.url, "region": "us-east-1"},
        "cache": {"dir": str(cache)}, "datasets": datasets})
    server = start(path)
    told = {}
    try:
        for name in datasets:
            with pytest.raises(RemoteError) as info:
                with RemoteLoader(server.address, name, batch_size=1, shuffle=False,
                                  output="numpy", timeout=30) as loader:
                    list(loader)
            assert info.value.code == grpc.StatusCode.DATA_LOSS, info.value
            told[name] = info.value.details
    finally:
        assert server.stop() == 0, server.stderr
    secrets = [str(tmp_path), str(tmp_path.resolve()), str(cache), bucket, moto_endpoint.url]
    leaked = {n: d for n, d in told.items() if any(s in d for s in secrets)}
    ledger.record("storage", "DATA_LOSS for corrupt image, jsonl and parquet inputs, "
                  "local and on S3", tried=len(told), detail="files named relative to the "
                  f"dataset root; {len(leaked)} messages name a server path")
    assert not leaked, leaked
    for name, details in told.items():
        relative = kinds[name.split("-", 1)[1]][1]
        assert re.search(rf"\(?{re.escape(relative)}", details), (name, details)
    # The server's own log keeps the full path.
    assert str(local / "img" / "a" / "1.png") in server.stderr
