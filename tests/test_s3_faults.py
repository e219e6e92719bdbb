"""S3 for real: a moto server process, a fault proxy in front of it, S3Storage and a data server
reading through both. Faults are scheduled, not random: every run injects the same ones."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import botocore.exceptions as bx
import grpc
import numpy as np
import pytest
from epochs import epoch
from PIL import Image

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server.formats.config_base import S3Settings

from conftest import server_env
from s3_endpoint import (
    DROP,
    ERROR,
    THROTTLE,
    TRUNCATE,
    Fault,
    FaultProxy,
    MotoServer,
    always,
    fault_proxy_fixture,  # noqa: F401  (the fault_proxy fixture)
    first,
    fraction,
    moto_endpoint_fixture,  # noqa: F401  (the moto_endpoint fixture)
    new_bucket,
    put_objects,
    s3_client,
    s3_env,
    slow,
)

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


@pytest.fixture
def bucket(moto_endpoint: MotoServer) -> str:
    return new_bucket(s3_client(moto_endpoint.url))


# -- the endpoint and the proxy themselves ---------------------------------------------------

def test_boto3_through_the_proxy_without_faults(fault_proxy: FaultProxy, bucket: str) -> None:
    client = s3_client(fault_proxy.url)
    body = payload(300_000)
    client.put_object(Bucket=bucket, Key="a dir/x+y.bin", Body=body)
    assert client.get_object(Bucket=bucket, Key="a dir/x+y.bin")["Body"].read() == body
    got = client.get_object(Bucket=bucket, Key="a dir/x+y.bin", Range="bytes=10-19")
    assert got["Body"].read() == body[10:20]
    assert client.head_object(Bucket=bucket, Key="a dir/x+y.bin")["ContentLength"] == len(body)
    listed = client.list_objects_v2(Bucket=bucket, Prefix="a dir/")["Contents"]
    assert [o["Key"] for o in listed] == ["a dir/x+y.bin"]
    with pytest.raises(bx.ClientError) as info:
        client.get_object(Bucket=bucket, Key="missing")
    assert info.value.response["Error"]["Code"] == "NoSuchKey"
    assert fault_proxy.requests == 6 and not fault_proxy.faults
    assert fault_proxy.connections == 1  # keep-alive: one connection for all six
    assert [r.key for r in fault_proxy.requests_for("a dir/x+y.bin", method=None)] == [
        "a dir/x+y.bin"] * 4
    assert not fault_proxy.errors


def _get(client: Any, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.mark.parametrize(("fault", "error", "code"), [
    (THROTTLE, bx.ClientError, "SlowDown"),
    (ERROR, bx.ClientError, "InternalError"),
    (DROP, bx.ConnectionClosedError, None),
    (TRUNCATE, bx.ResponseStreamingError, None),
    (slow(30), bx.ReadTimeoutError, None),
], ids=["throttle", "error", "drop", "truncate", "slow"])
def test_each_fault_reaches_a_client_without_retries(
        moto_endpoint: MotoServer, fault_proxy: FaultProxy, bucket: str, fault: Fault,
        error: type[Exception], code: str | None) -> None:
    body = payload(100_000)
    s3_client(moto_endpoint.url).put_object(Bucket=bucket, Key="k", Body=body)
    fault_proxy.schedule = first(1, fault)
    client = s3_client(fault_proxy.url, attempts=1, read_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(error) as info:
        _get(client, bucket, "k")
    assert time.monotonic() - started < 10  # a slow response is cut by the read timeout
    if code is not None:
        assert info.value.response["Error"]["Code"] == code  # type: ignore[attr-defined]
    assert fault_proxy.faults == {fault.kind: 1}
    assert _get(client, bucket, "k") == body  # the second attempt is not faulted
    assert fault_proxy.requests == 2


def test_a_slow_first_byte_within_the_timeout_only_delays(
        moto_endpoint: MotoServer, fault_proxy: FaultProxy, bucket: str) -> None:
    s3_client(moto_endpoint.url).put_object(Bucket=bucket, Key="k", Body=b"late")
    fault_proxy.schedule = first(1, slow(0.3))
    started = time.monotonic()
    assert _get(s3_client(fault_proxy.url, read_timeout=5), bucket, "k") == b"late"
    assert time.monotonic() - started >= 0.3
    assert fault_proxy.faults == {"slow": 1}


def test_botocore_retries_through_scheduled_faults(
        moto_endpoint: MotoServer, fault_proxy: FaultProxy, bucket: str) -> None:
    s3_client(moto_endpoint.url).put_object(Bucket=bucket, Key="k", Body=b"data")
    fault_proxy.schedule = first(2, THROTTLE, key="k")
    client = s3_client(fault_proxy.url, attempts=3)
    assert _get(client, bucket, "k") == b"data"
    assert [r.attempt for r in fault_proxy.requests_for("k")] == [1, 2, 3]
    assert fault_proxy.faults == {"throttle": 2}


def test_permanent_failure_and_fraction_schedules(fault_proxy: FaultProxy, bucket: str) -> None:
    fault_proxy.schedule = always(ERROR)
    client = s3_client(fault_proxy.url, attempts=2)
    with pytest.raises(bx.ClientError):
        client.list_objects_v2(Bucket=bucket)
    assert fault_proxy.faults == {"error": 2}
    # fraction(): the same requests fail however often it is asked, and never past max_attempt.
    pick = fraction(0.5, [THROTTLE, DROP], seed=3)
    from s3_endpoint import Request

    reqs = [Request(i, "GET", bucket, f"k{i}", "", 1, "") for i in range(200)]
    chosen = [pick(r) for r in reqs]
    assert chosen == [pick(r) for r in reqs]
    assert 60 < sum(c is not None for c in chosen) < 140
    assert {c.kind for c in chosen if c} == {"throttle", "drop"}
    assert pick(Request(1, "GET", bucket, "k", "", 2, "")) is None


def test_closing_the_proxy_cuts_a_slow_response_short(
        moto_endpoint: MotoServer, bucket: str) -> None:
    s3_client(moto_endpoint.url).put_object(Bucket=bucket, Key="k", Body=b"x")
    proxy = FaultProxy(moto_endpoint.url, first(1, slow(60))).start()
    client = s3_client(proxy.url, read_timeout=60)
    errors: list[BaseException] = []

    def get() -> None:
        try:
            _get(client, bucket, "k")
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=get)
    t.start()
    deadline = time.monotonic() + 10
    while not proxy.faults and time.monotonic() < deadline:
        threading.Event().wait(0.02)
    started = time.monotonic()
    proxy.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - started < 10
    assert errors and isinstance(errors[0], bx.ConnectionClosedError)


# -- S3Storage, in this process --------------------------------------------------------------

def _settings(url: str, **kw: Any) -> S3Settings:
    kw = {"max_attempts": 5, "connect_timeout": 2, "read_timeout": 2, "range_bytes": MiB,
          "range_concurrency": 4, **kw}
    return S3Settings(endpoint_url=url, region="us-east-1", **kw)


@pytest.fixture
def open_s3(tmp_path: Path):
    """open_s3(url, settings, cache_dir=None) -> an S3Storage with a DiskCache under tmp_path."""
    s3 = pytest.importorskip("stoker.server.sources.s3")
    cache_mod = pytest.importorskip("stoker.server.sources.cache")

    def open_(url: str, settings: S3Settings, cache_dir: Path | None = None,
              max_bytes: int = 256 * MiB, prefetch_bytes: int = 64 * MiB) -> Any:
        cache = cache_mod.DiskCache(cache_dir or tmp_path / "cache", max_bytes)
        return s3.S3Storage(url, settings, cache, prefetch_bytes=prefetch_bytes)

    return open_


def test_list_many_objects_with_a_glob(moto_endpoint: MotoServer, fault_proxy: FaultProxy,
                                       bucket: str, open_s3) -> None:
    objects = {f"data/{c}/{i:04d}.bin": bytes(i % 7) for c in "ab"
               for i in range(530)}  # 1060 objects: more than one page of list_objects_v2
    objects["data/a/notes.txt"] = b"not matched"
    objects["data/a/sub/deep.bin"] = b"not matched by a/*.bin"
    objects["other/x.bin"] = b"outside the prefix"
    put_objects(s3_client(moto_endpoint.url), bucket, objects)
    store = open_s3(f"s3://{bucket}/data", _settings(fault_proxy.url))
    everything = store.list()
    assert [o.key for o in everything] == sorted(k[5:] for k in objects if k.startswith("data/"))
    found = store.list("a/*.bin")
    assert [o.key for o in found] == [f"a/{i:04d}.bin" for i in range(530)]
    assert [o.size for o in found] == [i % 7 for i in range(530)]
    assert len({o.version for o in found}) == 7  # ETags: same bytes, same tag
    assert [o.key for o in store.list("**/*.bin")] == sorted(
        k[5:] for k in objects if k.startswith("data/") and k.endswith(".bin"))
    assert sum(r.method == "GET" and not r.key for r, _ in fault_proxy.seen) >= 4  # pages


def test_a_large_object_is_read_in_ranges_and_cached(
        moto_endpoint: MotoServer, fault_proxy: FaultProxy, bucket: str, open_s3,
        tmp_path: Path) -> None:
    big, small = payload(20 * MiB + 123, seed=1), payload(1000, seed=2)
    put_objects(s3_client(moto_endpoint.url), bucket, {"p/big.bin": big, "p/small.bin": small})
    store = open_s3(f"s3://{bucket}/p", _settings(fault_proxy.url))
    assert store.info("big.bin").size == len(big)
    assert store.read("big.bin") == big
    gets = fault_proxy.requests_for("p/big.bin")
    assert len(gets) == 21 and all(r.range for r in gets)  # 1 MiB parts, one request each
    assert store.read_range("big.bin", 5 * MiB - 10, 20) == big[5 * MiB - 10:5 * MiB + 10]
    assert store.read_range("big.bin", len(big) - 3, 3) == big[-3:]
    assert store.read_range("small.bin", 0, 1000) == small
    path = store.local_path("big.bin")
    assert path.is_relative_to(tmp_path / "cache") and path.read_bytes() == big
    before = fault_proxy.requests
    assert store.read("big.bin") == big  # from the disk cache
    # A new process (a new storage and cache object on the same folder) finds it too.
    again = open_s3(f"s3://{bucket}/p", _settings(fault_proxy.url))
    again.list()
    assert again.read("big.bin") == big
    assert not [r for r, _ in fault_proxy.seen[before:] if r.method == "GET" and r.key]


def test_a_missing_object_or_bucket_is_an_error_naming_the_url(
        fault_proxy: FaultProxy, bucket: str, open_s3, ledger) -> None:
    from stoker.server.sources import StorageError

    store = open_s3(f"s3://{bucket}/p", _settings(fault_proxy.url))
    for call in (lambda: store.read("nope.bin"), lambda: store.info("nope.bin"),
                 lambda: store.read_range("nope.bin", 0, 4)):
        with pytest.raises(StorageError) as info:
            call()
        assert f"s3://{bucket}/p/nope.bin" in str(info.value)
    gone = open_s3("s3://no-such-bucket-here/p", _settings(fault_proxy.url))
    with pytest.raises(StorageError) as info:
        gone.list()
    assert "s3://no-such-bucket-here/p" in str(info.value)
    ledger.record("storage", "S3 object or bucket missing", tried=4,
                  detail="StorageError naming the s3:// URL (read, info, range, list)")


@pytest.mark.parametrize("fault", [THROTTLE, ERROR, DROP, TRUNCATE, slow(5)],
                         ids=["throttle", "error", "drop", "truncate", "slow"])
def test_reads_get_the_right_bytes_through_faults(
        moto_endpoint: MotoServer, fault_proxy: FaultProxy, bucket: str, open_s3,
        fault: Fault, ledger) -> None:
    big, small = payload(3 * MiB + 5, seed=3), payload(5000, seed=4)
    put_objects(s3_client(moto_endpoint.url), bucket, {"p/big.bin": big, "p/a.bin": small})
    # Every request (list, head, each range GET) fails on its first attempt.
    fault_proxy.schedule = first(1, fault, method=None)
    store = open_s3(f"s3://{bucket}/p", _settings(fault_proxy.url, read_timeout=0.5))
    assert [o.key for o in store.list()] == ["a.bin", "big.bin"]
    assert store.read("big.bin") == big
    assert store.read("a.bin") == small
    assert store.read_range("big.bin", MiB - 2, 5) == big[MiB - 2:MiB + 3]
    # list 1; big.bin 4 ranges; a.bin 1; the range 1: each fails once, then succeeds.
    assert fault_proxy.faults == {fault.kind: 1 + 4 + 1 + 1}, fault_proxy.seen
    assert fault_proxy.requests == 2 * fault_proxy.faults[fault.kind]
    ledger.record("storage", f"S3 {fault.kind} on the first attempt of every request",
                  tried=fault_proxy.faults[fault.kind],
                  detail="retried: list, ranged and whole reads return the right bytes")


@pytest.mark.parametrize("fault", [ERROR, DROP, slow(5)], ids=["error", "drop", "slow"])
def test_a_permanent_failure_is_a_clear_error_in_bounded_time(
        moto_endpoint: MotoServer, fault_proxy: FaultProxy, bucket: str, open_s3,
        fault: Fault, ledger) -> None:
    from stoker.server.sources import StorageError

    put_objects(s3_client(moto_endpoint.url), bucket, {"p/a.bin": b"abc"})
    store = open_s3(f"s3://{bucket}/p", _settings(fault_proxy.url, max_attempts=3,
                                                   connect_timeout=0.5, read_timeout=0.5))
    store.list()
    fault_proxy.schedule = always(fault)
    fault_proxy.reset()
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        store.read("a.bin")
    assert time.monotonic() - started < 20
    assert f"s3://{bucket}/p/a.bin" in str(info.value)
    # max_attempts is the number of requests, as in AWS's own config (not 3 x 3, not 3 + 1).
    assert fault_proxy.requests == 3, fault_proxy.seen
    ledger.record("storage", f"S3 {fault.kind} on every request (permanent)",
                  detail=f"StorageError naming the URL after max_attempts (3) requests, "
                         f"{time.monotonic() - started:.1f} s")


def test_prefetch_fills_the_cache_without_blocking_and_fetches_once(
        moto_endpoint: MotoServer, fault_proxy: FaultProxy, bucket: str, open_s3) -> None:
    objects = {f"p/{i}.bin": payload(20_000, seed=i) for i in range(12)}
    put_objects(s3_client(moto_endpoint.url), bucket, objects)
    store = open_s3(f"s3://{bucket}/p", _settings(fault_proxy.url))
    store.list()
    # Every fetch held 1.2 s (under read_timeout): a prefetch that waited for a fetch would
    # take that long. One that does not can still take a while on a busy machine (starting
    # the pool's threads while they run botocore takes turns at the GIL: 0.32 s seen on 2
    # cores), hence 0.8 s.
    fault_proxy.schedule = first(1, slow(1.2))
    started = time.monotonic()
    store.prefetch([f"{i}.bin" for i in range(12)] + ["not-listed.bin"])
    assert time.monotonic() - started < 0.8  # a hint: it does not wait for the fetches
    for i in range(12):
        assert store.read(f"{i}.bin") == objects[f"p/{i}.bin"]
    for i in range(12):
        assert len(fault_proxy.requests_for(f"p/{i}.bin")) == 1


def test_two_caches_on_one_folder_download_an_object_once(
        moto_endpoint: MotoServer, fault_proxy: FaultProxy, bucket: str, open_s3,
        tmp_path: Path) -> None:
    body = payload(2 * MiB, seed=9)
    put_objects(s3_client(moto_endpoint.url), bucket, {"p/x.bin": body})
    # Two storages with their own DiskCache on one folder, as two worker processes have;
    # the first download is slow, so the second reader comes while it is under way.
    stores = [open_s3(f"s3://{bucket}/p", _settings(fault_proxy.url), tmp_path / "shared")
              for _ in range(2)]
    for s in stores:
        s.list()
    fault_proxy.schedule = first(1, slow(0.5))
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda s=s: results.append(s.read("x.bin")))
               for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [body, body]
    assert len(fault_proxy.requests_for("p/x.bin")) == 2  # two 1 MiB ranges, once


# -- a data server reading s3:// through the faults ------------------------------------------

def metrics_of(server: ServerProcess) -> dict[str, float]:
    """The unlabelled samples of a server's /metrics."""
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, _, v in (line.partition(" ") for line in lines)
            if k and not k.startswith("#") and "{" not in k}


def test_a_server_reads_an_image_folder_from_s3_through_faults(
        moto_endpoint: MotoServer, fault_proxy: FaultProxy, bucket: str,
        tmp_path: Path, ledger) -> None:
    pytest.importorskip("stoker.server.sources.s3")
    local = tmp_path / "pics"
    rng = np.random.default_rng(7)
    objects = {}
    for c in ("cat", "dog", "emu"):
        (local / c).mkdir(parents=True)
        for i in range(9):
            path = local / c / f"{i}.png"
            Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).save(path)
            objects[f"pics/{c}/{i}.png"] = path.read_bytes()
    put_objects(s3_client(moto_endpoint.url), bucket, objects)
    config = write_config(tmp_path / "config.yaml", {
        "s3": {"endpoint_url": fault_proxy.url, "region": "us-east-1", "max_attempts": 4,
               "connect_timeout": 2, "read_timeout": 2},
        # shared_batches 0: the second epoch is read again (from the disk cache), not served
        # from the batches kept for other jobs
        "cache": {"dir": str(tmp_path / "cache"), "max_bytes": "64MiB", "shared_batches": 0},
        "datasets": {
            "remote": {"format": "image-folder", "source": f"s3://{bucket}/pics", "size": 6},
            "local": {"format": "image-folder", "source": str(local), "size": 6}}})
    # About a third of all requests (list and get) fail once: throttled, 500, or cut off.
    fault_proxy.schedule = fraction(0.35, [THROTTLE, ERROR, DROP, TRUNCATE], seed=11,
                                    method=None)

    read = {"batch_size": 4, "seed": 5, "drop_last": False}
    with ServerProcess(config, workers=2, env={**server_env(), **s3_env()}) as server:
        remote = epoch(server, "remote", **read)
        cold = metrics_of(server)
        gets = sum(r.method == "GET" and r.key.endswith(".png") for r, _ in fault_proxy.seen)
        again = epoch(server, "remote", **read)  # the second time, from the disk cache
        gets_again = sum(r.method == "GET" and r.key.endswith(".png")
                         for r, _ in fault_proxy.seen)
        warm = metrics_of(server)
        expected = epoch(server, "local", **read)
    # /metrics: the first epoch filled the cache (27 objects), the second read from it.
    assert cold["stoker_cache_misses_total"] >= 27 and cold["stoker_cache_fetched_bytes_total"] > 0
    assert warm["stoker_cache_hits_total"] - cold["stoker_cache_hits_total"] >= 27
    assert warm["stoker_cache_misses_total"] == cold["stoker_cache_misses_total"]
    assert server.proc is not None and server.proc.returncode == 0, server.stderr
    indices = np.concatenate([b["sample_index"] for b in remote])
    lost, dup = ledger.compare(indices.tolist(), np.concatenate(
        [b["sample_index"] for b in expected]).tolist())
    ledger.record("storage", "a server reading S3 while 35% of requests are throttled, 500, "
                  "reset or truncated once", tried=sum(fault_proxy.faults.values()), lost=lost,
                  duplicated=dup, detail="the epoch equals the local copy's, byte for byte")
    assert lost == dup == 0
    assert sorted(indices.tolist()) == list(range(27))  # none lost, none twice
    assert len(remote) == len(expected)
    for got, want in zip(remote, expected, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    for got, want in zip(again, expected, strict=True):
        np.testing.assert_array_equal(got["image"], want["image"])
    assert fault_proxy.faults["throttle"] and fault_proxy.faults["drop"], fault_proxy.faults
    assert sum(fault_proxy.faults.values()) >= 5
    assert gets_again == gets  # the second run read no object again


# -- a server's disk cache under a small bound, and a broken TCP path to the endpoint ----------

def test_metrics_count_what_a_failed_batch_fetched(
        moto_endpoint: MotoServer, bucket: str, tmp_path: Path) -> None:
    """The disk cache's counters are the workers' own, read at the scrape: objects fetched
    for a batch that failed count though no batch was built after it (they rode on the next
    built batch's result before, and a scrape between missed them)."""
    rng = np.random.default_rng(3)
    objects = {}
    for i in range(3):
        path = tmp_path / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).save(path)
        objects[f"pics/cat/{i}.png"] = path.read_bytes()
    objects["pics/cat/3.png"] = b"not a png"
    put_objects(s3_client(moto_endpoint.url), bucket, objects)
    config = write_config(tmp_path / "config.yaml", {
        "s3": {"endpoint_url": moto_endpoint.url, "region": "us-east-1"},
        "cache": {"dir": str(tmp_path / "cache"), "max_bytes": "64MiB"},
        "datasets": {"remote": {"format": "image-folder", "source": f"s3://{bucket}/pics",
                                "size": 6}}})
    with ServerProcess(config, workers=1, env={**server_env(), **s3_env()}) as server:
        with RemoteLoader(server.address, "remote", batch_size=4, seed=0, output="numpy",
                          timeout=60) as loader, pytest.raises(RemoteError, match=r"3\.png"):
            list(loader)
        stats = metrics_of(server)
    assert stats["stoker_cache_misses_total"] == len(objects), stats
    assert stats["stoker_cache_fetched_bytes_total"] == sum(map(len, objects.values()))


def _noise_pngs(local: Path, n: int, side: int) -> dict[str, bytes]:
    """n random-noise PNGs (incompressible: about side*side*3 bytes each) in one class."""
    rng = np.random.default_rng(n)
    (local / "a").mkdir(parents=True)
    objects = {}
    for i in range(n):
        path = local / "a" / f"{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(path)
        objects[f"pics/a/{i:03d}.png"] = path.read_bytes()
    return objects


def _cache_bytes(root: Path) -> int:
    """Bytes of finished entries (temp files being written and locks not counted)."""
    total = 0
    for f in root.glob("*/*"):
        if f.parent.name != ".locks" and not f.name.startswith(".tmp-"):
            try:
                total += f.stat().st_size
            except FileNotFoundError:  # evicted meanwhile
                pass
    return total


def test_a_small_disk_cache_stays_within_its_bound_and_serving_goes_on(
        moto_endpoint: MotoServer, bucket: str, tmp_path: Path, ledger) -> None:
    objects = _noise_pngs(tmp_path / "pics", 40, 110)  # about 36 KiB each, 1.4 MiB in all
    put_objects(s3_client(moto_endpoint.url), bucket, objects)
    limit, workers = MiB, 2
    config = write_config(tmp_path / "config.yaml", {
        "s3": {"endpoint_url": moto_endpoint.url, "region": "us-east-1"},
        "cache": {"dir": str(tmp_path / "cache"), "max_bytes": limit},
        "datasets": {
            "remote": {"format": "image-folder", "source": f"s3://{bucket}/pics", "size": 4},
            "local": {"format": "image-folder", "source": str(tmp_path / "pics"), "size": 4}}})
    # Each worker evicts after adding 1/16 of the limit: over by at most that and one object
    # per worker, between evictions.
    bound = limit + workers * (limit // 16 + max(map(len, objects.values())))
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], _cache_bytes(tmp_path / "cache"))

    def indices(server: ServerProcess, name: str, e: int) -> list[int]:
        return epoch(server, name, set_epoch=e, batch_size=4, seed=3).indices()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ServerProcess(config, workers=workers, env={**server_env(), **s3_env()}) as server:
            got = indices(server, "remote", 0) + indices(server, "remote", 1)
            want = indices(server, "local", 0) + indices(server, "local", 1)
            stats = metrics_of(server)
    finally:
        done.set()
        watcher.join(10)
    lost, dup = ledger.compare(got, want)
    ledger.record("storage", "S3 disk cache bound (1 MiB) smaller than the dataset (1.4 MiB)",
                  lost=lost, duplicated=dup,
                  detail=f"two epochs served; cache peak {peak[0] >> 10} KiB, bound "
                         f"{bound >> 10} KiB; {stats['stoker_cache_misses_total']:.0f} misses")
    assert lost == dup == 0 and got == want
    assert 0 < peak[0] <= bound and _cache_bytes(tmp_path / "cache") <= bound
    # The second epoch had to fetch again what was evicted: the bound was really in force.
    assert stats["stoker_cache_misses_total"] > len(objects)


@pytest.mark.parametrize(("mode", "kw"), [("drop", {}), ("stall", {}),
                                          ("truncate", {"limit": 3000})])
def test_a_broken_tcp_path_to_s3_mid_epoch_costs_nothing(
        moto_endpoint: MotoServer, bucket: str, tmp_path: Path, ledger, mode: str,
        kw: dict[str, Any]) -> None:
    from tcp_proxy import TcpProxy

    objects = _noise_pngs(tmp_path / "pics", 32, 40)
    put_objects(s3_client(moto_endpoint.url), bucket, objects)
    with TcpProxy(moto_endpoint.url.removeprefix("http://")) as proxy:
        config = write_config(tmp_path / "config.yaml", {
            "s3": {"endpoint_url": f"http://{proxy.address}", "region": "us-east-1",
                   "max_attempts": 8, "connect_timeout": 1, "read_timeout": 2},
            # No prefetch: every object is fetched when its batch is built, during the fault.
            "cache": {"dir": str(tmp_path / "cache"), "prefetch_bytes": 0},
            "datasets": {
                "remote": {"format": "image-folder", "source": f"s3://{bucket}/pics",
                           "size": 4},
                "local": {"format": "image-folder", "source": str(tmp_path / "pics"),
                          "size": 4}}})
        heal = threading.Event()

        def fault() -> None:
            proxy.set(mode, **kw)
            threading.Thread(target=lambda: heal.wait(1.0) or proxy.set("pass"),
                             daemon=True).start()

        with ServerProcess(config, workers=2, env={**server_env(), **s3_env()}) as server:
            got: list[int] = []
            with RemoteLoader(server.address, "remote", batch_size=2, seed=4, output="numpy",
                              timeout=60) as loader:
                for k, batch in enumerate(loader):
                    got += batch["sample_index"].tolist()
                    if k == 1:
                        fault()
            with RemoteLoader(server.address, "local", batch_size=2, seed=4, output="numpy",
                              timeout=60) as loader:
                want = [int(i) for b in loader for i in b["sample_index"]]
    lost, dup = ledger.compare(got, want)
    ledger.record("network", f"{mode} the server's TCP path to S3 for 1 s, mid-epoch",
                  lost=lost, duplicated=dup,
                  detail=f"botocore retried; {proxy.refused} connections refused, "
                         f"{proxy.truncated} cut")
    assert lost == dup == 0 and got == want


def test_a_tcp_path_to_s3_broken_for_good_is_unavailable_naming_the_object(
        moto_endpoint: MotoServer, bucket: str, tmp_path: Path, ledger) -> None:
    from tcp_proxy import TcpProxy

    put_objects(s3_client(moto_endpoint.url), bucket, _noise_pngs(tmp_path / "pics", 8, 16))
    with TcpProxy(moto_endpoint.url.removeprefix("http://")) as proxy:
        config = write_config(tmp_path / "config.yaml", {
            "s3": {"endpoint_url": f"http://{proxy.address}", "region": "us-east-1",
                   "max_attempts": 2, "connect_timeout": 0.5, "read_timeout": 0.5},
            "cache": {"dir": str(tmp_path / "cache"), "prefetch_bytes": 0},
            "datasets": {"remote": {"format": "image-folder", "source": f"s3://{bucket}/pics",
                                    "size": 4}}})
        with ServerProcess(config, workers=1, env={**server_env(), **s3_env()}) as server:
            proxy.set("drop")
            started = time.monotonic()
            with pytest.raises(RemoteError) as info:
                with RemoteLoader(server.address, "remote", batch_size=2, shuffle=False,
                                  output="numpy", timeout=6) as loader:
                    list(loader)
            took = time.monotonic() - started
    # An outage, not bad data: answered UNAVAILABLE, which the client asks other servers
    # about; with none, it gives up after its timeout, naming the cause.
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no server delivered batch" in info.value.details, info.value.details
    # Sample 0 was read at start (to describe the fields), and is cached: a later one fails.
    # Named relative to the dataset's root: the bucket is the server's business.
    assert re.search(r"sample [1-7]: a/00[1-7]\.png: \w+Error",
                     info.value.details), info.value.details
    assert bucket not in info.value.details
    assert "after 2 attempts" in info.value.details
    ledger.record("network", "the server's TCP path to S3 reset for good",
                  detail=f"UNAVAILABLE naming the object after {took:.1f} s (the loader's "
                         "timeout, 6 s)")


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 512 KiB tmpfs, for a cache folder on a disk that fills up (root only: mount)."""
    import subprocess

    where = tmp_path / "small-disk"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)],
            capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_full_cache_disk_does_not_stop_serving(moto_endpoint: MotoServer, bucket: str,
                                                 tmp_path: Path, small_disk: Path,
                                                 ledger) -> None:
    objects = _noise_pngs(tmp_path / "pics", 40, 110)  # 1.4 MiB: more than the disk holds
    put_objects(s3_client(moto_endpoint.url), bucket, objects)
    config = write_config(tmp_path / "config.yaml", {
        "s3": {"endpoint_url": moto_endpoint.url, "region": "us-east-1"},
        # The bound is above the disk's size: the disk fills before the cache evicts.
        "cache": {"dir": str(small_disk), "max_bytes": "64MiB", "prefetch_bytes": 0},
        "datasets": {
            "remote": {"format": "image-folder", "source": f"s3://{bucket}/pics", "size": 4},
            "local": {"format": "image-folder", "source": str(tmp_path / "pics"), "size": 4}}})

    with ServerProcess(config, workers=2, env={**server_env(), **s3_env()}) as server:
        got, want = (epoch(server, "remote", batch_size=4, seed=3).indices(),
                     epoch(server, "local", batch_size=4, seed=3).indices())
    lost, dup = ledger.compare(got, want)
    ledger.record("storage", "the S3 disk cache's disk full (512 KiB tmpfs, 1.4 MiB of data)",
                  lost=lost, duplicated=dup, detail="served: objects that do not fit are "
                  "read past the cache")
    assert lost == dup == 0 and got == want
