"""The cache of the deterministic prefix: what a pipeline computes before its first random
step (an image's decode and the `resize`/`center_crop` steps listed first; a python dataset's
`prepare`), kept as arrays, shared by every worker process of one server.

Everything before the first random step depends on (dataset content, sample index) alone, not
on (seed, epoch): from the second epoch on, and for every job with another seed, it is read
here instead of computed. Entries are keyed by the dataset's fingerprint, the stage's own
config (which steps, which field) and the sample index, so a changed dataset or a changed
prefix never meets a stale entry.

Two tiers, each a folder of entry files, bounded in bytes, least recently used evicted first:

    memory  <shm>/stoker-prefix-<server pid>/        cache.decoded_bytes  (tmpfs: RAM)
    disk    <spill_dir>/stoker-prefix-<server pid>/  cache.spill_bytes

An entry evicted from memory moves to disk (when a disk tier is configured); a disk hit is
served from there (the page cache), not promoted back. Why files, and not one shared arena:
- sharing across processes needs no allocator of our own: tmpfs is the shared-memory
  allocator, and a worker killed mid-write (kill -9; the pool replaces it) leaves at worst a
  temporary file, never a half-written entry that others read: entries are written under a
  temporary name and renamed into place (atomic), and never changed after;
- readers take no lock: they map the file (an evicted entry that is unlinked while mapped
  stays readable until unmapped: the kernel keeps its pages);
- recency is the file's mtime, touched on each hit; eviction is one writer at a time under
  an fcntl lock (released by the kernel when its holder dies), which lists the folder, sums
  what is really there (so a count left wrong by a crash heals at the next eviction) and
  removes the oldest until the tier is at EVICT_TO of its bound: a listing serves many
  insertions, not one. Between listings each tier's byte total is kept in a small shared
  file, updated under the same lock.
A tier may exceed its bound by the entries being written at that moment (one per worker).

Hit and miss counts are per worker process, each in a small file of its own in the memory
folder (one writer, no lock); the server's /metrics sums them (server/front/metrics.py). The
server removes both folders on exit (server/pool/workers.py), and at start those of servers that
are no longer running.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .cache import alive, file_lock

log = logging.getLogger("stoker.server")

PREFIX = "stoker-prefix-"
EVICT_TO = 0.95  # an eviction frees down to this share of the bound
PAGE = 4096  # entries are counted in whole pages: what tmpfs and the page cache hold
ALIGN = 64  # each array's offset in an entry
MAGIC = b"STKPFX1\n"
# Per-worker counters, int64 each, in this order (stats/<pid>).
STATS = ("memory_hits", "memory_misses", "disk_hits", "disk_misses")
_ENTRIES, _TMP, _LOCK, _TOTALS, _STATS = "e", ".tmp-", ".lock", ".totals", "stats"


def shm_root() -> Path:
    """Where the memory tier lives: /dev/shm (tmpfs) where there is one."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def memory_dir(server_pid: int) -> Path:
    return shm_root() / f"{PREFIX}{server_pid}"


def spill_root(settings: Any) -> Path:
    """The spill folder's parent: `cache.spill_dir`, default `cache.dir/prefix`."""
    return Path(settings.spill_dir) if settings.spill_dir is not None \
        else Path(settings.dir) / "prefix"


def enabled(settings: Any) -> bool:
    return int(settings.decoded_bytes) > 0 or int(settings.spill_bytes) > 0


def remove(settings: Any, server_pid: int) -> None:
    """Remove server `server_pid`'s cache (both tiers)."""
    shutil.rmtree(memory_dir(server_pid), ignore_errors=True)
    shutil.rmtree(spill_root(settings) / f"{PREFIX}{server_pid}", ignore_errors=True)


def sweep(settings: Any) -> int:
    """Remove the caches of servers that are no longer running; how many were removed."""
    removed = 0
    for root in (shm_root(), spill_root(settings)):
        try:
            found = [p for p in root.iterdir() if p.name.startswith(PREFIX)]
        except OSError:
            continue
        for path in found:
            pid = path.name[len(PREFIX):]
            if pid.isdigit() and not alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
    return removed


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _write_entry(path: Path, arrays: dict[str, np.ndarray]) -> int:
    """Write `arrays` as one entry file; its size in bytes."""
    specs: list[dict[str, Any]] = []
    offset = 0
    for name, a in arrays.items():
        specs.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape),
                      "offset": offset})
        offset += -(-a.nbytes // ALIGN) * ALIGN
    header = json.dumps(specs).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // ALIGN) * ALIGN
    with open(path, "wb") as f:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header)
        for spec, a in zip(specs, arrays.values(), strict=True):
            f.seek(start + spec["offset"])
            f.write(np.ascontiguousarray(a).data)
        f.truncate(start + offset)
        return start + offset


def _read_entry(fd: int) -> dict[str, np.ndarray]:
    """The arrays of an entry file, mapped copy-on-write: no copy is made, and the arrays
    are writable (a write stays in this process; the entry never changes)."""
    mm = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if mm[:len(MAGIC)] != MAGIC:
        raise ValueError("not a prefix cache entry")
    n = int.from_bytes(mm[len(MAGIC):len(MAGIC) + 8], "little")
    specs = json.loads(mm[len(MAGIC) + 8:len(MAGIC) + 8 + n])
    start = -(-(len(MAGIC) + 8 + n) // ALIGN) * ALIGN
    out = {}
    for s in specs:
        dtype = np.dtype(s["dtype"])
        count = int(np.prod(s["shape"], dtype=np.int64))
        out[s["name"]] = np.frombuffer(mm, dtype, count, start + s["offset"]).reshape(s["shape"])
    return out


class _Tier:
    """One folder of entries, bounded by `bound` bytes; its total at `slot` of `totals`."""

    def __init__(self, name: str, folder: Path, bound: int, totals: np.ndarray, slot: int,
                 below: _Tier | None = None) -> None:
        self.name, self.folder, self.bound = name, folder, bound
        self.entries = folder / _ENTRIES
        self.entries.mkdir(parents=True, exist_ok=True)
        self.totals, self.slot, self.below = totals, slot, below
        self._warned: set[int | None] = set()  # errnos of failed adds, logged once each

    def open(self, key: str) -> int | None:
        """A descriptor of entry `key`, marked recently used; None if absent."""
        try:
            fd = os.open(self.entries / key, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            os.utime(fd)
        except OSError:
            pass  # recency is a hint
        return fd

    def add(self, key: str, write: Callable[[Path], int]) -> bool:
        """Store an entry written by `write(path) -> bytes`; False if it cannot be kept (larger
        than the tier, or the file system refused it)."""
        tmp = self.entries / f"{_TMP}{os.getpid()}-{key}"
        try:
            size = _pages(write(tmp))
            if size > self.bound:
                tmp.unlink()
                return False
            with file_lock(self.folder / _LOCK):
                if self.totals[self.slot] + size > self.bound:
                    self._evict(size)
                os.rename(tmp, self.entries / key)
                self.totals[self.slot] += size
            return True
        except OSError as e:
            # A cache that cannot keep an entry is a miss next time, never a failed sample:
            # a full disk, or a spill folder gone read-only or away. Said once per cause.
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if e.errno not in self._warned:
                self._warned.add(e.errno)
                why = ("no room left" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                       else "cannot write")
                log.warning("prefix cache %s tier: %s in %s: %s (entries it cannot keep are "
                            "computed again; said once)", self.name, why, self.folder, e)
            return False

    def _evict(self, need: int) -> None:
        """Under the lock: remove the least recently used entries (moving them to the tier
        below, if any) until `need` more bytes fit under EVICT_TO of the bound."""
        found = []
        for entry in os.scandir(self.entries):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.startswith(_TMP):  # not counted: its writer adds it at rename
                pid = entry.name[len(_TMP):].split("-", 1)[0]
                if pid.isdigit() and not alive(int(pid)):  # a writer that died mid-write
                    os.unlink(entry.path)
                continue
            found.append((st.st_mtime_ns, _pages(st.st_size), entry.name, entry.path))
        total = sum(f[1] for f in found)
        target = int(self.bound * EVICT_TO) - need
        for _, size, name, path in sorted(found):
            if total <= target:
                break
            if self.below is not None:
                self.below.add(name, functools.partial(_copy, path))
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            total -= size
        self.totals[self.slot] = total


def _copy(src: str, dst: Path) -> int:
    shutil.copyfile(src, dst)
    return os.stat(dst).st_size


class PrefixCache:
    """A worker process's handle on its server's prefix cache. Not thread-safe in its
    counters (a worker builds on one thread); the tiers are safe across processes."""

    def __init__(self, settings: Any, server_pid: int) -> None:
        mem = memory_dir(server_pid)
        (mem / _STATS).mkdir(parents=True, exist_ok=True)
        self.totals = _shared(mem / _TOTALS, 2)
        self.stats = _shared(mem / _STATS / str(os.getpid()), len(STATS))
        disk = None
        if int(settings.spill_bytes) > 0:
            disk = _Tier("disk", spill_root(settings) / f"{PREFIX}{server_pid}",
                         int(settings.spill_bytes), self.totals, 1)
        memory = None
        if int(settings.decoded_bytes) > 0:
            memory = _Tier("memory", mem, int(settings.decoded_bytes), self.totals, 0, disk)
        self.tiers = [t for t in (memory, disk) if t is not None]

    def scope(self, fingerprint: str) -> Callable[[str, str], Scope]:
        """scope(stage, spec): the entries of one stage (`spec`: its config, as text) of the
        dataset whose fingerprint this is."""
        return lambda stage, spec: Scope(self, f"{fingerprint}\0{stage}\0{spec}")

    def get(self, key: str) -> dict[str, np.ndarray] | None:
        for tier in self.tiers:
            fd = tier.open(key)
            if fd is None:
                self._count(f"{tier.name}_misses")
                continue
            try:
                out = _read_entry(fd)
            except (ValueError, OSError):
                out = None  # a damaged entry (a full disk): computed again
            finally:
                os.close(fd)
            if out is not None:
                self._count(f"{tier.name}_hits")
                return out
        return None

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        for tier in self.tiers:  # the first tier that takes it
            if tier.add(key, lambda path: _write_entry(path, arrays)):
                return

    def _count(self, what: str) -> None:
        self.stats[STATS.index(what)] += 1


class Scope:
    """One stage's entries: get(index) / put(index, arrays)."""

    def __init__(self, cache: PrefixCache, scope: str) -> None:
        self.cache, self.scope = cache, scope

    def _key(self, index: int) -> str:
        return hashlib.blake2b(f"{self.scope}\0{index}".encode(), digest_size=20).hexdigest()

    def get(self, index: int) -> dict[str, np.ndarray] | None:
        return self.cache.get(self._key(index))

    def put(self, index: int, arrays: dict[str, np.ndarray]) -> None:
        self.cache.put(self._key(index), arrays)


def use_cache(scope: Callable[[str, str], Scope], pipelines: list[tuple[str, Any]]) -> None:
    """Give each image field's pipeline (name, ImagePipeline or None) its entries."""
    for name, pipeline in pipelines:
        if pipeline is not None:
            pipeline.use_cache(scope(f"field {name}", pipeline.prefix_spec))


def _shared(path: Path, n: int) -> np.ndarray:
    """n int64 counters in file `path` (made zero if new), mapped shared."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_size < 8 * n:
            os.ftruncate(fd, 8 * n)
        mm = mmap.mmap(fd, 8 * n)
    finally:
        os.close(fd)
    return np.frombuffer(mm, np.int64, n)


def read_stats(server_pid: int) -> dict[str, int]:
    """The counters of every worker (past and present) of server `server_pid`, summed, and
    each tier's bytes (`memory_bytes`, `disk_bytes`); {} where it keeps no prefix cache."""
    mem = memory_dir(server_pid)
    try:
        files = list((mem / _STATS).iterdir())
        totals = np.fromfile(mem / _TOTALS, np.int64, 2)
    except OSError:
        return {}
    out = dict.fromkeys(STATS, 0)
    for f in files:
        try:
            values = np.fromfile(f, np.int64, len(STATS))
        except OSError:
            continue
        for name, v in zip(STATS, values.tolist(), strict=False):
            out[name] += v
    out["memory_bytes"], out["disk_bytes"] = (int(v) for v in totals) if len(totals) == 2 \
        else (0, 0)
    return out


def open_for_worker(settings: Any) -> PrefixCache | None:
    """This worker's handle on its server's (parent's) cache; None where none is configured."""
    if not enabled(settings):
        return None
    return PrefixCache(settings, os.getppid())
