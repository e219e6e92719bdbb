"""The storage layer without a server: local directories, globs, the disk cache, orderings."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest

from stoker.server.order.sampling import Ordering
from stoker.server.sources import StorageError, glob_regex, open_storage, split_source
from stoker.server.sources.cache import DiskCache


@pytest.mark.parametrize(("source", "root", "pattern"), [
    ("/data/train", "/data/train", None),
    ("/data/train/", "/data/train", None),
    ("/data/*.jsonl", "/data", "*.jsonl"),
    ("s3://b/p/**/*.tar", "s3://b/p", "**/*.tar"),
    ("s3://b/shard-[0-9].tar", "s3://b", "shard-[0-9].tar"),
    ("*.bin", ".", "*.bin"),
])
def test_split_source(source: str, root: str, pattern: str | None) -> None:
    assert split_source(source) == (root, pattern)


@pytest.mark.parametrize(("pattern", "yes", "no"), [
    ("*.tar", ["a.tar"], ["d/a.tar", "a.tar.gz"]),
    ("**/*.tar", ["a.tar", "d/a.tar", "d/e/a.tar"], ["a.tgz"]),
    ("d/?.bin", ["d/1.bin"], ["d/12.bin", "d/x/1.bin"]),
    ("s-[0-9].bin", ["s-3.bin"], ["s-x.bin"]),
    ("s-[!0-9].bin", ["s-x.bin"], ["s-3.bin"]),
    ("a+b(1).txt", ["a+b(1).txt"], ["aab1.txt"]),
])
def test_glob(pattern: str, yes: list[str], no: list[str]) -> None:
    match = glob_regex(pattern).match
    assert all(match(k) for k in yes) and not any(match(k) for k in no)


def test_a_local_file_source_is_its_folder_and_its_name(tmp_path: Path) -> None:
    (tmp_path / "odd[1]*.bin").write_bytes(b"x")
    (tmp_path / "odd1x.bin").write_bytes(b"y")
    root, pattern = split_source(str(tmp_path / "odd[1]*.bin"))
    assert root == str(tmp_path) and pattern is not None
    assert [o.key for o in open_storage(root).list(pattern)] == ["odd[1]*.bin"]


def test_local_storage_lists_reads_and_stays_inside_its_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"0123456789")
    (root / "d" / "b.bin").write_bytes(b"xy")
    (root / ".hidden").write_bytes(b"h")
    (tmp_path / "secret").write_bytes(b"s")
    (root / "link").symlink_to(tmp_path / "secret")
    st = open_storage(str(root))
    assert [o.key for o in st.list("**/*.bin")] == ["a.bin", "d/b.bin"]
    assert st.info("a.bin").size == 10
    assert st.read("d/b.bin") == b"xy" and st.read_range("a.bin", 3, 4) == b"3456"
    assert st.local_path("a.bin") == (root / "a.bin").resolve()
    for escape in ("../secret", "link", "d/../../secret"):
        with pytest.raises(StorageError, match="outside the dataset root"):
            st.read(escape)
    with pytest.raises(StorageError, match="nope"):
        st.read("nope")
    with pytest.raises(StorageError, match="unsupported URL scheme"):
        open_storage("gs://bucket/x")


def test_cache_fetches_once_and_serves_the_same_bytes(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20)
    calls = []

    def fetch(fd: int) -> None:
        calls.append(1)
        os.write(fd, b"payload")

    assert cache.read("s3://b/k", "v1", fetch) == b"payload"
    assert cache.read("s3://b/k", "v1", fetch) == b"payload"
    assert len(calls) == 1 and (cache.hits, cache.misses) == (1, 1)
    cache.read("s3://b/k", "v2", fetch)  # a new version is a new entry
    assert len(calls) == 2
    # Survives a restart: a new cache object over the same folder finds the entries.
    again = DiskCache(tmp_path, 1 << 20)
    assert again.read("s3://b/k", "v1", fetch) == b"payload" and len(calls) == 2


def test_a_failed_fetch_leaves_nothing_behind(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20)

    def broken(fd: int) -> None:
        os.write(fd, b"half")
        raise ConnectionError("reset")

    with pytest.raises(ConnectionError):
        cache.get("s3://b/k", "v", broken)
    assert not cache.entry("s3://b/k", "v").exists()
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.parent.name != ".locks"]


def test_cache_evicts_least_recently_used(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20)  # a full MiB; entries of 200 KiB
    blob = b"x" * (200 << 10)
    for i in range(5):
        cache.get(f"s3://b/{i}", "v", lambda fd: os.write(fd, blob))
    cache.get("s3://b/0", "v", lambda fd: os.write(fd, blob))  # a hit: 0 is now the newest
    os.utime(cache.entry("s3://b/1", "v"), ns=(1, 1))  # make 1 clearly the oldest
    cache.get("s3://b/5", "v", lambda fd: os.write(fd, blob))  # 1.2 MiB: over the limit
    kept = {i for i in range(6) if cache.entry(f"s3://b/{i}", "v").exists()}
    assert 1 not in kept and {0, 5} <= kept
    total = sum(cache.entry(f"s3://b/{i}", "v").stat().st_size for i in kept)
    assert total <= (1 << 20) * 9 // 10


def _fetch_in_process(root: str, barrier: mp.synchronize.Barrier, log: str) -> None:
    cache = DiskCache(Path(root), 1 << 30)

    def fetch(fd: int) -> None:
        with open(log, "a") as f:
            f.write("fetch\n")
        os.write(fd, b"z" * (1 << 20))

    barrier.wait(timeout=30)
    assert cache.read("s3://b/shared", "v", fetch) == b"z" * (1 << 20)


def test_processes_sharing_a_cache_download_an_object_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(4)
    log = tmp_path / "fetches.log"
    procs = [ctx.Process(target=_fetch_in_process, args=(str(tmp_path / "c"), barrier, str(log)))
             for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert log.read_text().count("fetch") == 1


def test_block_ordering_is_a_permutation_that_keeps_windows_of_shards() -> None:
    starts = np.arange(0, 100, 10)  # 10 shards of 10 samples
    ordering = Ordering(100, starts, block=True, window=2)
    order = ordering.epoch(7, 0, True)
    assert sorted(order.tolist()) == list(range(100))
    # Each run of 20 consecutive positions draws from exactly 2 shards.
    for w in range(0, 100, 20):
        assert len(set((order[w : w + 20] // 10).tolist())) == 2
    assert np.array_equal(order, Ordering(100, starts, True, 2).epoch(7, 0, True))  # pure
    assert not np.array_equal(order, ordering.epoch(7, 1, True))  # a new order each epoch
    assert np.array_equal(ordering.epoch(7, 0, False), np.arange(100))
    # Without shards (or one shard), block is the global shuffle.
    assert np.array_equal(Ordering(100, None, True, 2).epoch(7, 0, True),
                          Ordering(100).epoch(7, 0, True))
