"""A disk cache for remote objects, shared by a server's worker processes, kept across restarts.

Layout: DIR/ab/abcdef... (sha256 of the object's URL and version): a new version of an object
is a new entry, and a stale one ages out. Constraints it keeps:
- a half-written file is never read: entries are written to a temp name and renamed into place;
- several processes asking for the same missing object download it once: the first holds an
  fcntl lock on the entry while it fetches, the others wait on the lock and then find the file;
- the byte limit holds within a slack: each process counts what it added and, past 1/16 of the
  limit, scans the folder and deletes the least recently used entries (a hit touches the file's
  mtime) until the total is under 90% of the limit. A process that has the entry open keeps
  reading it after the unlink (POSIX); one that had only its path fetches it again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("stoker.server")

LOCKS = ".locks"
TMP = ".tmp-"


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


class DiskCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        (self.root / LOCKS).mkdir(parents=True, exist_ok=True)
        self._added = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.bytes_fetched = 0
        self._warned_full = False
        self._remove_stale_temps()

    def entry(self, url: str, version: str) -> Path:
        digest = hashlib.sha256(f"{url}\0{version}".encode()).hexdigest()
        return self.root / digest[:2] / digest

    def get(self, url: str, version: str, fetch: Callable[[int], None]) -> Path:
        """The cached file for (url, version); on a miss, `fetch(fd)` writes the object into
        an open temp file first (any exception it raises leaves nothing behind)."""
        path = self.entry(url, version)
        if self._touch(path):
            return path
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
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                raise
        with self._lock:
            self.misses += 1
            self.bytes_fetched += size
            self._added += size
            due = self._added > self.max_bytes // 16
            if due:
                self._added = 0
        if due:
            self.evict()
        return path

    def read(self, url: str, version: str, fetch: Callable[[int], None]) -> bytes:
        """The object's bytes, through the cache; past it when the cache's disk is full."""
        for _ in range(3):
            try:
                path = self.get(url, version, fetch)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                return self._read_past(url, fetch, e)
            try:
                return path.read_bytes()
            except FileNotFoundError:  # evicted between get() and the read: fetch again
                continue
        raise OSError(f"{url}: evicted from the disk cache as soon as fetched; "
                      f"cache.max_bytes ({self.max_bytes}) is too small for the working set")

    def _read_past(self, url: str, fetch: Callable[[int], None], error: OSError) -> bytes:
        """Fetch into memory, keeping nothing: a full disk (shared with others, or smaller
        than max_bytes) makes the cache useless, not the data unreadable."""
        if not self._warned_full:
            self._warned_full = True
            log.warning("disk cache %s: %s; objects that do not fit are read without caching",
                        self.root, error.strerror)
        fd = os.memfd_create("stoker-fetch") if hasattr(os, "memfd_create") else None
        with open(fd, "w+b") if fd is not None else tempfile.TemporaryFile() as f:
            fetch(f.fileno())
            f.seek(0)
            data = f.read()
        with self._lock:
            self.misses += 1
            self.bytes_fetched += len(data)
        return data

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
        try:
            os.utime(path)
        except FileNotFoundError:
            return False
        with self._lock:
            self.hits += 1
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
