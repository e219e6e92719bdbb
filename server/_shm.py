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
import mmap
import os
import re
from pathlib import Path

_DEV_SHM = Path("/dev/shm")
_NAME = re.compile(r"^stoker_(\d+)_")


def prefix(server_pid: int) -> str:
    return f"stoker_{server_pid}_"


def create(name: str, size: int) -> mmap.mmap:
    """A new segment of `size` bytes (at least 1), mapped read-write."""
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        return mmap.mmap(fd, max(size, 1))
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


def open_readonly(name: str) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


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
        if (pid == server_pid) if server_pid is not None else not _alive(pid):
            unlink(entry.name)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True
