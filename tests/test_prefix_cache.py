"""The prefix cache (cache.decoded_bytes): served batches are bit-identical with the cache
on or off, cold or warm, for every format with images and for a python dataset's `prepare`;
the tiers stay within their bounds, evicting the least recently used and spilling to disk;
entries outlive a worker killed with SIGKILL."""

from __future__ import annotations

import io
import os
import shutil
import signal
import tarfile
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from epochs import epoch
from PIL import Image

from stoker.server import ServerProcess, write_config
from stoker.server.sources.prefix_cache import PrefixCache, memory_dir, read_stats, remove

from conftest import server_env

pytestmark = pytest.mark.timeout(180)

N = 12
AUGMENT = [{"random_resized_crop": {"size": 24}}, {"horizontal_flip": {}},
           {"normalize": {}}]


def jpeg(i: int) -> bytes:
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (38 + i, 50, 3), dtype=np.uint8)).save(
        buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same images as an image folder, a tar shard and a parquet file."""
    root = tmp_path_factory.mktemp("prefix")
    for c in ("a", "b"):
        (root / "folder" / c).mkdir(parents=True)
    (root / "tar").mkdir()
    (root / "parquet").mkdir()
    with tarfile.open(root / "tar" / "0.tar", "w") as tf:
        for i in range(N):
            data = jpeg(i)
            (root / "folder" / "ab"[i % 2] / f"{i:02d}.jpg").write_bytes(data)
            member = tarfile.TarInfo(f"{i:04d}.jpg")
            member.size = len(data)
            tf.addfile(member, io.BytesIO(data))
    pq.write_table(pa.table({"image": pa.array([jpeg(i) for i in range(N)], pa.binary()),
                             "label": pa.array(range(N), pa.int64())}),
                   root / "parquet" / "0.parquet", row_group_size=5)
    return {
        "folder": {"format": "image-folder", "source": str(root / "folder"),
                   "transforms": [{"resize": {"short": 32}}, *AUGMENT]},
        "native": {"format": "image-folder", "source": str(root / "folder")},
        "tar": {"format": "tar", "source": str(root / "tar"), "fields": {
            "image": {"ext": "jpg", "decode": "image", "transforms": AUGMENT},
            "small": {"ext": "jpg", "decode": "image", "size": 16}}},
        "parquet": {"format": "parquet", "source": str(root / "parquet"), "fields": {
            "image": {"decode": "image", "transforms": AUGMENT}, "label": {}}},
        "prepared": {"format": "python", "factory": "prefix_datasets:Encoded",
                     "prepare": "prefix_datasets:prepare",
                     "transform": "prefix_datasets:jitter"},
    }


def serve(tmp: Path, datasets: dict[str, Any], cache: dict[str, Any],
          workers: int = 2) -> ServerProcess:
    config = write_config(tmp / "config.yaml", {
        # shared_batches 0: every epoch goes through the pipeline (and the prefix cache), not
        # served from the batches kept for other jobs
        "cache": {"dir": str(tmp / "cache"), "shared_batches": 0, **cache},
        "datasets": datasets})
    return ServerProcess(config, workers=workers, env=server_env()).start()


def read(server: ServerProcess, name: str, e: int) -> list[dict[str, np.ndarray]]:
    """Epoch `e` of `name`, batches of 5, seed 3."""
    return epoch(server, name, set_epoch=e, batch_size=5, seed=3, drop_last=False)


def same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k])
                                     for k in x) for x, y in zip(a, b, strict=True))


def stats(server: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("stoker_prefix_cache_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def workers_of(server: ServerProcess) -> list[int]:
    tasks = Path(f"/proc/{server.proc.pid}/task")  # any of its threads may have started one
    children = [int(p) for t in tasks.iterdir() for p in (t / "children").read_text().split()]
    return [p for p in children  # not multiprocessing's resource tracker
            if Path(f"/proc/{p}/comm").read_text().startswith("stoker worker")]


def test_batches_are_bit_identical_with_the_cache_on_or_off_cold_or_warm_and_after_a_worker_dies(
        data: dict[str, Any], tmp_path: Path, ledger) -> None:
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    with serve(tmp_path / "off", data, {}, workers=1) as off, \
            serve(tmp_path / "on", data, {"decoded_bytes": "64MiB"}) as on:
        want = {name: [read(off, name, e) for e in (0, 1)] for name in data}
        assert not stats(off)  # no cache configured: no series
        for name in data:
            cold, warm = read(on, name, 0), read(on, name, 0)
            assert same(cold, want[name][0]) and same(warm, want[name][0]), name
            assert same(read(on, name, 1), want[name][1]), name  # another epoch: all hits
            assert not same(want[name][0], want[name][1]), name  # augmentation did happen
        warm = stats(on)
        assert warm['stoker_prefix_cache_hits_total{tier="memory"}'] > 0
        assert warm['stoker_prefix_cache_bytes{tier="memory"}'] > 0
        # A worker killed with SIGKILL: its replacement finds every entry.
        os.kill(workers_of(on)[0], signal.SIGKILL)
        on.wait_for_stderr("died .*starting another", timeout=60)
        for name in data:
            assert same(read(on, name, 1), want[name][1]), name
        after = stats(on)
        assert (after['stoker_prefix_cache_misses_total{tier="memory"}']
                == warm['stoker_prefix_cache_misses_total{tier="memory"}'])
        assert (after['stoker_prefix_cache_hits_total{tier="memory"}']
                > warm['stoker_prefix_cache_hits_total{tier="memory"}'])
        pid = on.proc.pid
        assert memory_dir(pid).is_dir()
    assert not memory_dir(pid).exists()  # removed at exit
    ledger.record("servers", "SIGKILL a worker with the prefix cache warm: entries survive, "
                  "batches bit-identical", lost=0, duplicated=0)


def settings(tmp_path: Path, memory: int, disk: int) -> SimpleNamespace:
    return SimpleNamespace(decoded_bytes=memory, spill_bytes=disk, spill_dir=tmp_path,
                           dir=tmp_path)


def entry(i: int) -> dict[str, np.ndarray]:
    return {"pixels": np.full((64, 64), i, np.uint8)}  # one 4 KiB page, and the header's


def test_tiers_stay_within_their_bounds_evict_the_least_recently_used_and_spill(
        tmp_path: Path) -> None:
    pid = os.getpid()  # this process plays the server; the cache is its own
    size = 8192  # an entry: its header's page and its pixels' page
    try:
        cache = PrefixCache(settings(tmp_path, 4 * size, 6 * size), pid)
        scope = cache.scope("sha256:test")("field image", "spec")
        for i in range(3):
            scope.put(i, entry(i))
        assert scope.get(0) is not None  # 0 is now more recently used than 1 and 2
        for i in range(3, 20):
            scope.put(i, entry(i))
            held = read_stats(pid)
            assert held["memory_bytes"] <= 4 * size and held["disk_bytes"] <= 6 * size
        memory = list((memory_dir(pid) / "e").iterdir())
        disk = list((tmp_path / f"stoker-prefix-{pid}" / "e").iterdir())
        assert sum(f.stat().st_size for f in memory) <= 4 * size
        assert 0 < len(disk) and sum(f.stat().st_size for f in disk) <= 6 * size
        got = {i: scope.get(i) for i in range(20)}
        kept = [i for i, v in got.items() if v is not None]
        assert all(np.array_equal(got[i]["pixels"], entry(i)["pixels"]) for i in kept)
        assert 19 in kept and 1 not in kept and len(kept) <= 10
        counts = read_stats(pid)
        assert counts["disk_hits"] > 0 and counts["memory_hits"] > 0
        # Another dataset (fingerprint) or prefix never meets these entries.
        assert cache.scope("sha256:other")("field image", "spec").get(19) is None
        assert cache.scope("sha256:test")("field image", "other").get(19) is None
    finally:
        remove(settings(tmp_path, 0, 0), pid)
    assert not memory_dir(pid).exists()


def test_a_spill_folder_that_cannot_be_written_is_a_miss_said_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Only a disk tier, whose folder goes away under it (an unmounted disk, a cleaner): an
    # entry it cannot keep is computed again next time, never a failed sample.
    pid = os.getpid()
    try:
        cache = PrefixCache(settings(tmp_path, 0, 1 << 20), pid)
        scope = cache.scope("sha256:test")("field image", "spec")
        scope.put(0, entry(0))
        assert scope.get(0) is not None
        shutil.rmtree(tmp_path / f"stoker-prefix-{pid}")
        with caplog.at_level("WARNING", logger="stoker.server"):
            for i in range(1, 4):
                scope.put(i, entry(i))  # no exception: not kept
                assert scope.get(i) is None
        said = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
        assert len(said) == 1 and "disk tier" in said[0], said
    finally:
        remove(settings(tmp_path, 0, 0), pid)


def test_a_python_dataset_with_prepare_and_its_own_sample_is_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", {"datasets": {"bad": {
        "format": "python", "factory": "prefix_datasets:OwnSample",
        "prepare": "prefix_datasets:prepare"}}})
    with pytest.raises(RuntimeError, match="prepare"):
        ServerProcess(config, workers=1, env=server_env()).start()


def test_a_misspelled_cache_key_is_named_with_the_closest_one(tmp_path: Path) -> None:
    from stoker.server import ConfigError, load_config

    config = write_config(tmp_path / "c.yaml", {"cache": {"decoded_byte": "1GiB"}, "datasets": {
        "a": {"format": "python", "factory": "m:f"}}})
    with pytest.raises(ConfigError, match=r"cache\.decoded_byte: .*did you mean 'decoded_bytes'"):
        load_config(config)
