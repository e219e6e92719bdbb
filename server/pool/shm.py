"""Named POSIX shared-memory segments that carry batch payloads from workers to the front end.

Not multiprocessing.shared_memory: it reports every open and unlink to the resource tracker
over a pipe, and those writes blocked the front end for about a fifth of its time. Cleanup
after a crash comes instead from the names: every segment is `stoker_<server pid>_...`, a
server sweeps its own on exit, and at start removes those of servers that no longer run.

The primitive is CPython's _posixshmem (what shared_memory itself uses), so this stays POSIX
portable; listing segments for the sweep needs /dev/shm (Linux) and is skipped elsewhere.
"""

from __future__ import annotations

import _posixshmem
import errno
import mmap
import os
import re
import time
from pathlib import Path

from ..sources.cache import alive

_DEV_SHM = Path("/dev/shm")
_NAME = re.compile(r"^stoker_(\d+)_")


def prefix(server_pid: int) -> str:
    return f"stoker_{server_pid}_"


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def capacity() -> tuple[int, int]:
    """(size, free bytes) of /dev/shm; (0, 0) where it cannot be read."""
    try:
        st = os.statvfs(_DEV_SHM)
    except OSError:
        return 0, 0
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def more_shm(need: int = 4 << 30) -> str:
    """What an operator does when /dev/shm is too small: said in every message about it."""
    gib = max(1, -(-need // (1 << 30)))
    return (f"give the server more shared memory (docker run --shm-size={gib}g; Kubernetes: "
            "an emptyDir with medium: Memory mounted on /dev/shm)")


class ShmFull(Exception):
    """/dev/shm has no room for a segment. `larger_than_all`: it could not hold this one even
    empty (asking again cannot help). The message names /dev/shm, its size, what was needed
    and the settings to change."""

    def __init__(self, needed: int) -> None:
        total, free = capacity()
        self.needed, self.total = needed, total
        self.larger_than_all = 0 < total < needed
        if self.larger_than_all:
            text = (f"/dev/shm holds {mib(total)} in all and this batch needs {mib(needed)}: "
                    f"{more_shm(needed)}, or ask for smaller batches")
        else:
            text = (f"/dev/shm is full ({mib(total)}, {mib(total - free)} used) and this "
                    f"batch needs {mib(needed)}: {more_shm()}, or lower server.workers or "
                    "server.max_credits (each holds batches there)")
        super().__init__(text)


def _reserve(fd: int, start: int, end: int) -> None:
    """Give bytes [start, end) of a segment their pages now. ftruncate alone reserves
    nothing: on a full /dev/shm the first write to a page past the limit is a SIGBUS, which
    kills the worker. The zeroing a first write would do is done here instead, and only for
    new or grown segments (workers reuse theirs). Raises ShmFull; a file system without
    fallocate keeps the old behaviour."""
    if end <= start:
        return
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ShmFull(end) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def create(name: str, size: int) -> mmap.mmap:
    """A new segment of `size` bytes (at least 1), mapped read-write, its pages reserved.
    Raises ShmFull (the segment is gone) when /dev/shm has no room for it."""
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        _reserve(fd, 0, max(size, 1))
        return mmap.mmap(fd, max(size, 1))
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


class ReadMappings:
    """Read-only mappings of the workers' segments, kept from batch to batch (or, writable,
    a worker's mappings of the segments the pool builds batches in parts into).

    Mapping a segment afresh costs a page-table fault per 4 KiB page the first time each is
    read (measured: 12 ms instead of 8 ms to read 64 MiB); workers reuse their segments, so
    the front end keeps its mappings too. A mapping goes once its segment is unlinked (the
    worker dropped it, or was replaced): an unlinked segment's memory lives on for as long as
    anyone maps it, so mappings whose segments have no link left are closed (below).
    A segment that grew is mapped again. Used from the event loop's thread only.

    The check for unlinked segments (an fstat per mapping) runs when a segment is mapped for
    the first time, which is when workers turn their segments over, and every SWEEP_EVERY
    gets in any case. Where many segments are mapped (batches kept for other jobs, see
    front/shared_batches.py: a lone job's every batch is then a new segment), a check per new
    segment cost an fstat per kept batch per batch (a quarter of the front end's time at
    64 KiB batches): a new mapping then checks only once the new mappings since the last
    check are an eighth of those held, or SWEEP_BYTES (at most SWEEP_SHARE fstats per new
    mapping); the periodic check comes every as many gets as mappings held if that is
    longer than SWEEP_EVERY: at most one fstat per get (with 1,024 batches kept, 8 per get
    had been a twentieth of the front end's time). An unlinked segment's memory is held at
    most about that much longer (segments are unlinked as new ones are made).
    """

    SWEEP_EVERY = 64
    SWEEP_BYTES = 64 << 20
    SWEEP_SHARE = 8  # a new mapping checks once new ones are 1/8 of those held

    def __init__(self, writable: bool = False) -> None:
        # writable: a worker's mappings of the pool's segments, which it writes parts of
        # batches into (see pool/parts.py); the same rules keep and drop them.
        self._flags, self._prot = ((os.O_RDWR, mmap.PROT_READ | mmap.PROT_WRITE) if writable
                                   else (os.O_RDONLY, mmap.PROT_READ))
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}  # name -> (fd, mapping)
        self._gets = 0  # since the last check
        self._new = self._new_bytes = 0  # segments (and their bytes) mapped since then

    def get(self, name: str, size: int) -> mmap.mmap:
        """A mapping of at least the first `size` bytes of segment `name` (read-only unless
        made writable)."""
        self._gets += 1
        new = name not in self._maps
        if new:
            self._new += 1
            self._new_bytes += size
        count = len(self._maps)
        if (self._gets >= max(self.SWEEP_EVERY, count)
                or (new and (self._new * self.SWEEP_SHARE >= count
                             or self._new_bytes >= self.SWEEP_BYTES))):
            self._drop_unlinked()
        held = self._maps.get(name)
        if held is not None and len(held[1]) >= size:
            return held[1]
        if name in self._maps:
            self._close(name)
        fd = _posixshmem.shm_open("/" + name, self._flags, mode=0o600)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=self._prot)
        except BaseException:
            os.close(fd)
            raise
        self._maps[name] = (fd, mm)
        return mm

    def _drop_unlinked(self) -> None:
        self._gets = self._new = self._new_bytes = 0
        for name in [n for n, (fd, _) in self._maps.items() if os.fstat(fd).st_nlink == 0]:
            self._close(name)

    def _close(self, name: str) -> None:
        fd, mm = self._maps.pop(name)
        os.close(fd)
        try:
            mm.close()
        except BufferError:  # a view is still out (a send being torn down): the GC closes it
            pass

    def close(self) -> None:
        for name in list(self._maps):
            self._close(name)


def unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


_PROBE = re.compile(r"^stoker_client_\d+_[0-9a-f]{32}$")


def same_host(probe_name: str, token: bytes) -> bool:
    """Whether a client's probe segment is readable here, owned by this user, and starts with
    `token`: then the client shares this host's /dev/shm and can read our segments (mode
    0600, same user). The name is checked against the one pattern clients use: never a path.
    """
    if not _PROBE.match(probe_name) or len(token) != 16:
        return False
    try:
        fd = _posixshmem.shm_open("/" + probe_name, os.O_RDONLY, mode=0o600)
    except OSError:
        return False
    try:
        return os.fstat(fd).st_uid == os.getuid() and os.pread(fd, 16, 0) == token
    except OSError:
        return False
    finally:
        os.close(fd)


def worker_prefix(server_pid: int, worker_pid: int) -> str:
    return f"{prefix(server_pid)}{worker_pid}_"


def worker_of(name: str) -> int | None:
    """The worker pid in a segment name `stoker_<server>_<worker>_<n>`."""
    parts = name.split("_")
    return int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else None


def remove_prefixed(name_prefix: str, keep: set[str]) -> int:
    """Unlink every segment whose name starts with `name_prefix`, except those in `keep`."""
    if not _DEV_SHM.is_dir():
        return 0
    gone = [e.name for e in _DEV_SHM.iterdir()
            if e.name.startswith(name_prefix) and e.name not in keep]
    for name in gone:
        unlink(name)
    return len(gone)


ROUND = 64 << 10  # capacities grow in these steps, so a pool of batches of one size settles
# A give-back asks /dev/shm for its free bytes (a statvfs) at most every ROOM_CHECK seconds
# while the last answer left room for ROOM_MARGIN more segments like it; on every give-back
# once room is tighter. A statvfs per batch was 4% of a worker's CPU at 64 KiB batches.
ROOM_CHECK = 0.05
ROOM_MARGIN = 16


def rounded(size: int) -> int:
    """The capacity of a new segment for `size` bytes: a whole number of ROUND steps."""
    return max(-(-size // ROUND) * ROUND, ROUND)


class SegmentPool:
    """A worker process's segments, reused from batch to batch.

    Writing a fresh segment costs a page fault per 4 KiB page (about 1 CPU-second per GB
    collated; the wire benchmark measured it as most of the workers' transport cost); a
    segment that was written before costs none. The front end sends a segment back once its
    batch is on the wire (`give_back`); at most `keep` free ones are kept (past `keep_min`,
    only while they hold `keep_bytes` at most), the rest unlinked: a worker's idle memory is
    bounded.
    Not thread-safe: one per worker process, used by its one building thread.
    """

    def __init__(self, name_prefix: str, keep: int, keep_min: int | None = None,
                 keep_bytes: int = 0) -> None:
        self._prefix = name_prefix
        self._keep = keep
        # Past keep_min free segments, more are kept only while they hold keep_bytes at most.
        self._keep_min = keep if keep_min is None else keep_min
        self._keep_bytes = keep_bytes
        self._count = 0
        self._free: list[tuple[str, mmap.mmap]] = []
        self._lent: dict[str, mmap.mmap] = {}
        self._roomy_until = 0.0  # time.monotonic() before which /dev/shm is not asked again

    def acquire(self, size: int) -> tuple[str, mmap.mmap]:
        """A segment of at least `size` bytes, mapped read-write; lent until given back.

        Raises ShmFull when /dev/shm has no room, even after this worker's own idle segments
        were freed to make some."""
        size = rounded(size)
        try:
            name, mm = self._take(size)
        except ShmFull:
            if not self._free:
                raise
            self._release_free()
            name, mm = self._take(size)
        self._lent[name] = mm
        return name, mm

    def _release_free(self) -> None:
        """Free every idle segment's memory now."""
        for name, mm in self._free:
            _drop_idle(name, mm)
        self._free.clear()

    def _take(self, size: int) -> tuple[str, mmap.mmap]:
        fits = [i for i, (_, m) in enumerate(self._free) if len(m) >= size]
        if fits:
            i = min(fits, key=lambda i: len(self._free[i][1]))
            name, mm = self._free.pop(i)
        elif self._free:  # grow the largest: its pages so far stay faulted in
            name, old = self._free.pop(max(range(len(self._free)),
                                           key=lambda i: len(self._free[i][1])))
            old.close()
            mm = _resize(name, size)
        else:
            self._count += 1
            name = f"{self._prefix}{self._count}"
            mm = create(name, size)
        return name, mm

    def give_back(self, name: str) -> None:
        mm = self._lent.pop(name, None)
        if mm is None:
            return  # not ours, or already back
        self._free.append((name, mm))
        if len(self._free) > self._keep or (
                len(self._free) > self._keep_min
                and sum(len(m) for _, m in self._free) > self._keep_bytes):
            # the smallest is the least useful
            small = min(range(len(self._free)), key=lambda i: len(self._free[i][1]))
            _drop_idle(*self._free.pop(small))
        elif not self._room_for(len(mm)):
            # /dev/shm could not hold another like it: idle memory goes back, for the other
            # workers' batches (with room to spare, segments are kept).
            _drop_idle(*self._free.pop())

    def _room_for(self, size: int) -> bool:
        """Whether /dev/shm has room for another segment of `size` bytes (see ROOM_CHECK)."""
        now = time.monotonic()
        if now < self._roomy_until:
            return True
        free = capacity()[1]
        if free >= ROOM_MARGIN * size:
            self._roomy_until = now + ROOM_CHECK
        return free >= size

    def discard(self, name: str) -> None:
        """A segment whose batch failed: unlinked, not reused (its size may be odd)."""
        mm = self._lent.pop(name, None)
        if mm is not None:
            mm.close()
        unlink(name)


def _drop_idle(name: str, mm: mmap.mmap) -> None:
    """Free an idle segment's memory now: emptied first, then unlinked. The front end may
    still map it (it drops mappings of unlinked segments only later), and an unlinked
    segment's pages stay taken for as long as anyone maps it. Nobody reads an idle segment
    (its batch was sent and given back), so emptying it is safe."""
    mm.close()
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        return
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    unlink(name)


def _resize(name: str, size: int) -> mmap.mmap:
    """Grow segment `name` to `size` bytes, the new pages reserved. Raises ShmFull (the
    segment is gone: a half-grown one is of no use) when /dev/shm has no room."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        old = os.fstat(fd).st_size
        os.ftruncate(fd, size)
        _reserve(fd, old, size)
        return mmap.mmap(fd, size)
    except BaseException:
        os.ftruncate(fd, 0)  # idle until now: the front end may map it (see _release_free)
        unlink(name)
        raise
    finally:
        os.close(fd)


def sweep(server_pid: int | None = None) -> int:
    """Remove the segments of `server_pid`, or (None) of every stoker server that is gone.

    Returns how many were removed."""
    if not _DEV_SHM.is_dir():
        return 0
    removed = 0
    for entry in _DEV_SHM.iterdir():
        match = _NAME.match(entry.name)
        if not match:
            continue
        pid = int(match.group(1))
        if (pid == server_pid) if server_pid is not None else not alive(pid):
            try:
                unlink(entry.name)
            except PermissionError:  # another user's, in a /dev/shm shared with them
                continue
            removed += 1
    return removed


