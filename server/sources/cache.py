"""A disk cache for remote objects, shared by a server's worker processes, kept across restarts.

Layout: DIR/ab/abcdef... (sha256 of the object's URL and version): a new version of an object
is a new entry, and a stale one ages out. Constraints it keeps:
- a half-written file is never read: entries are written to a temp name and renamed into place;
- several processes asking for the same missing object download it once: the first holds an
  fcntl lock on the entry while it fetches, the others wait on the lock and then find the file;
- the byte limit holds within a slack: each process counts what it added and, past 1/16 of the
  limit, scans the folder and deletes the least recently used entries (a hit touches the file's
  mtime) until the total is under 90% of the limit. A process that has the entry open keeps
  reading it after the unlink (POSIX); one that had only its path fetches it again;
- a cache whose disk is read-only or full (EROFS, EACCES, EPERM, ENOSPC, EDQUOT) makes the
  cache useless, not the data unreadable: objects are read past it, with one warning naming
  the folder. read() keeps nothing; get(), which must return a path (memory maps), fetches
  into an anonymous memory file (memfd) kept in a small per-process LRU ("scratch").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._lru import LRU

log = logging.getLogger("stoker.server")

LOCKS = ".locks"
TMP = ".tmp-"
HITS, MISSES, FETCHED = range(3)  # a cache's counters, in this order


@contextlib.contextmanager
def file_lock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive fcntl lock on `path` (created if missing) for the block; yields
    whether it is held: always with `wait`, False without it when another holder has it.

    The lock belongs to this open of the file (flock, not POSIX record locks), so it excludes
    other processes and other threads of this one alike, and it is released when the block
    ends or the process dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


# errno values that make the cache's disk useless, not the data unreadable: read past it.
DEGRADED = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})
# Of those, the ones that last (a remount or a chmod, seen only by a restarted server): stop
# trying to write. A full disk may free up, so writes are tried again.
READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
# Scratch: objects that get() fetched past a degraded cache, held as memory files. Bounded per
# process by bytes and count; a file still mapped by a format stays in memory until unmapped.
SCRATCH_BYTES = 512 << 20
SCRATCH_FILES = 64
# A path handed out is /proc/self/fd/N, which the caller opens at once. Its fd is not closed
# within this many seconds, so that N cannot be reused for another file before it is opened.
SCRATCH_GRACE = 30.0


@dataclass
class _Scratch:
    fd: int
    size: int
    handed_out: float  # time.monotonic() of the last get() that returned it

    @property
    def path(self) -> Path:
        return Path(f"/proc/self/fd/{self.fd}")


class DiskCache:
    """Thread-safe; processes share the folder (see the module's docstring)."""

    def __init__(self, root: Path, max_bytes: int, scratch_bytes: int = SCRATCH_BYTES,
                 counts: Any = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._added = 0
        self._lock = threading.Lock()
        # [hits, misses, bytes fetched], added to (never set): `counts` is the server's
        # shared int64 array for this worker's slot, which /metrics reads at each scrape (a
        # replacement worker adds to its predecessor's), or this cache's own.
        self._counts = np.frombuffer(counts, np.int64, 3) if counts is not None \
            else np.zeros(3, np.int64)
        self.writable = True  # False once its disk is known read-only: stop trying to write
        self._warned = False
        self._full = False  # the last write failed for want of space (it may free up)
        # Memory files past a read-only or full disk, closed on eviction (see SCRATCH_GRACE).
        self._scratch: LRU[str, _Scratch] = LRU(max_items=SCRATCH_FILES, max_size=scratch_bytes,
                                                size=lambda s: s.size)
        try:
            (self.root / LOCKS).mkdir(parents=True, exist_ok=True)
            self._remove_stale_temps()
        except OSError as e:
            if e.errno not in DEGRADED:
                raise
            self._degrade(e, for_good=True)  # not even set up: no write will work

    @property
    def degraded(self) -> bool:
        """Whether the disk refuses writes now (read-only, or full since the last write that
        worked): prefetching has nowhere to go."""
        return not self.writable or self._full

    @property
    def hits(self) -> int:
        """Objects read from the cache (with a predecessor's, where the counts are shared)."""
        return int(self._counts[HITS])

    @property
    def misses(self) -> int:
        """Objects fetched from remote storage."""
        return int(self._counts[MISSES])

    @property
    def bytes_fetched(self) -> int:
        return int(self._counts[FETCHED])

    def entry(self, url: str, version: str) -> Path:
        digest = hashlib.sha256(f"{url}\0{version}".encode()).hexdigest()
        return self.root / digest[:2] / digest

    def get(self, url: str, version: str, fetch: Callable[[int], None]) -> Path:
        """A local file with the bytes of (url, version): the cache entry, or past a read-only
        or full cache a memory file (open it at once: see SCRATCH_GRACE). On a miss,
        `fetch(fd)` writes the object into an open file first (any exception it raises leaves
        nothing behind)."""
        path = self.entry(url, version)
        found = self._cached(path)
        if found is not None:
            return found
        if self.writable:
            try:
                return self._fill(path, fetch)
            except OSError as e:
                if e.errno not in DEGRADED:
                    raise
                self._degrade(e)
        return self._fetch_to_scratch(path.name, fetch)

    def read(self, url: str, version: str, fetch: Callable[[int], None]) -> bytes:
        """The object's bytes, through the cache; past it when its disk is read-only or full."""
        for _ in range(3):
            path = self.entry(url, version)
            found = self._cached(path)
            if found is None and self.writable:
                try:
                    found = self._fill(path, fetch)
                except OSError as e:
                    if e.errno not in DEGRADED:
                        raise
                    self._degrade(e)
            if found is None:
                return self._read_past(fetch)
            try:
                return found.read_bytes()
            except FileNotFoundError:  # evicted between get() and the read: fetch again
                continue
        raise OSError(f"{url}: evicted from the disk cache as soon as fetched; "
                      f"cache.max_bytes ({self.max_bytes}) is too small for the working set")

    # -- filling the cache -----------------------------------------------------------------
    def _cached(self, path: Path) -> Path | None:
        """The entry if the cache has it (a hit), or the object's scratch file."""
        if self._touch(path):
            return path
        with self._lock:
            scratch = self._scratch.get(path.name)
            if scratch is None:
                return None
            scratch.handed_out = time.monotonic()
            self._counts[HITS] += 1
            return scratch.path

    def _fill(self, path: Path, fetch: Callable[[int], None]) -> Path:
        """Fetch into the cache; raises OSError with the disk's errno where it cannot."""
        # One lock file per 256th of the key space: few files, rare false sharing.
        with file_lock(self.root / LOCKS / path.name[:2]):
            if self._touch(path):  # another process fetched it while we waited
                return path
            path.parent.mkdir(exist_ok=True)
            tmp = path.parent / f"{TMP}{os.getpid()}-{threading.get_ident()}-{path.name}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    fetch(fd)
                    size = os.fstat(fd).st_size
                finally:
                    os.close(fd)
                os.rename(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):  # gone, or the disk went read-only
                    tmp.unlink()
                raise
            # Counted before the lock goes: a reader waiting on it (a hit) never returns
            # before the miss that filled the entry is counted.
            with self._lock:
                self._counts[MISSES] += 1
                self._counts[FETCHED] += size
                self._added += size
                due = self._added > self.max_bytes // 16
                if due:
                    self._added = 0
        self._full = False  # a write worked: the disk has room again
        if due:
            try:
                self.evict()
            except OSError as e:  # the disk went read-only since: the entry is there
                if e.errno not in DEGRADED:
                    raise
                self._degrade(e)
        return path

    # -- past the cache --------------------------------------------------------------------
    def _degrade(self, error: OSError, for_good: bool = False) -> None:
        """The cache's disk refused a write: say so once, and stop writing if it will last."""
        if for_good or error.errno in READ_ONLY:
            self.writable = False
        else:
            self._full = True
        with self._lock:
            if self._warned:
                return
            self._warned = True
        if not self.writable:
            log.warning("disk cache %s: %s; objects are read without caching (every epoch "
                        "fetches them again, and files that jsonl, tar, parquet, memmap, "
                        "tokens and text map are held in memory): make the folder writable "
                        "or point cache.dir elsewhere, and restart", self.root,
                        error.strerror or error)
        else:
            log.warning("disk cache %s: %s; objects that do not fit are read without caching "
                        "(fetched again when needed, and files that jsonl, tar, parquet, "
                        "memmap, tokens and text map are held in memory): free space or set "
                        "cache.max_bytes below what the disk holds", self.root,
                        error.strerror or error)

    def _memory_file(self, fetch: Callable[[int], None]) -> tuple[int, int]:
        """(fd, size) of a new memory file holding the object."""
        fd = os.memfd_create("stoker-fetch", os.MFD_CLOEXEC)
        try:
            fetch(fd)
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._counts[MISSES] += 1
            self._counts[FETCHED] += size
        return fd, size

    def _read_past(self, fetch: Callable[[int], None]) -> bytes:
        """Fetch into memory, keeping nothing."""
        fd, _ = self._memory_file(fetch)
        with open(fd, "rb") as f:  # closes fd
            f.seek(0)  # fetch may have written with write(), not pwrite()
            return f.read()

    def _fetch_to_scratch(self, name: str, fetch: Callable[[int], None]) -> Path:
        fd, size = self._memory_file(fetch)
        now = time.monotonic()
        entry = _Scratch(fd, size, now)

        def opening(s: _Scratch) -> bool:  # maybe not opened yet: over the bound for a while
            return now - s.handed_out < SCRATCH_GRACE

        closing = []
        with self._lock:
            old = self._scratch.pop(name)  # two threads fetched it: keep the newer
            if old is not None:  # under another name, closed as the LRU's oldest
                closing += self._scratch.put(f"{name}-{old.fd}", old, oldest=True,
                                             spare=opening)
            closing += self._scratch.put(name, entry, spare=opening)
        for _, s in closing:
            os.close(s.fd)
        return entry.path

    def evict(self) -> None:
        """Delete least recently used entries until the cache is under 90% of its limit."""
        with file_lock(self.root / LOCKS / "evict", wait=False) as mine:
            if not mine:
                return  # another process is evicting
            entries, total = [], 0
            for sub in os.scandir(self.root):
                if not sub.is_dir() or sub.name == LOCKS:
                    continue
                for f in os.scandir(sub.path):
                    if f.name.startswith(TMP):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        st = f.stat()
                        entries.append((st.st_mtime_ns, st.st_size, f.path))
                        total += st.st_size
            if total <= self.max_bytes:
                return
            entries.sort()
            goal = self.max_bytes * 9 // 10
            removed = 0
            for _, size, path in entries:
                if total <= goal:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    total -= size
                    removed += 1
            log.info("disk cache %s: evicted %d entries, %d bytes left", self.root, removed,
                     total)

    def _touch(self, path: Path) -> bool:
        """Whether the entry exists (a hit); marks it recently used where the disk allows."""
        try:
            if self.writable:
                os.utime(path)
            elif not path.is_file():
                return False
        except FileNotFoundError:
            return False
        except OSError as e:
            if e.errno not in DEGRADED:
                raise
            self._degrade(e)  # still a hit; its place in the LRU stays where it was
            if not path.is_file():
                return False
        with self._lock:
            self._counts[HITS] += 1
        return True

    def _remove_stale_temps(self) -> None:
        """Temp files of fetches that died with their process (older than an hour)."""
        cutoff = time.time() - 3600
        for sub in self.root.iterdir():
            if sub.is_dir() and sub.name != LOCKS:
                for f in sub.glob(f"{TMP}*"):
                    with contextlib.suppress(FileNotFoundError):
                        if f.stat().st_mtime < cutoff:
                            f.unlink()


def alive(pid: int) -> bool:
    """Whether process `pid` runs (on this host): what a file or segment named for its writer
    is judged by, when the writer may have died."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True
