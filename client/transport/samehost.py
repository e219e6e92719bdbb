"""Same-host delivery: batches read straight from the server's shared memory.

When the client and a server share a host (and a user), copying every batch through gRPC
and the loopback socket costs both sides CPU for nothing. The client leaves a small probe
segment in /dev/shm holding a random token and names it when it opens a stream; a server
that can read it (same /dev/shm, same user) answers with the name of each batch's segment
instead of its bytes. The client copies the payload into its own buffer with one read, then
releases the segment. gRPC stays the control path: credits, errors, ordering, failover.

Linux only (/dev/shm); elsewhere, or if the probe cannot be written, streams carry bytes.
"""

from __future__ import annotations

import atexit
import os
import secrets
import threading

import numpy as np

from stoker.v1 import stoker_pb2 as pb

_DEV_SHM = "/dev/shm"
_lock = threading.Lock()
_probe: tuple[int, pb.SharedMemoryProbe | None] | None = None  # (pid, probe)


def probe() -> pb.SharedMemoryProbe | None:
    """This process's probe segment, made on first use (and again after a fork)."""
    global _probe
    with _lock:
        if _probe is None or _probe[0] != os.getpid():
            _probe = (os.getpid(), _make_probe())
        return _probe[1]


def _sweep_probes() -> None:
    """Remove the probes of client processes that are gone: one killed (SIGKILL, OOM) never
    ran its atexit, and nothing else would ever remove its file."""
    try:
        names = os.listdir(_DEV_SHM)
    except OSError:
        return
    for name in names:
        pid = name.removeprefix("stoker_client_").partition("_")[0]
        if not name.startswith("stoker_client_") or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _unlink(os.path.join(_DEV_SHM, name))  # another user's files: EPERM, kept
        except OSError:
            pass  # alive, owned by another user


def _make_probe() -> pb.SharedMemoryProbe | None:
    if not os.path.isdir(_DEV_SHM):
        return None
    _sweep_probes()
    token = secrets.token_bytes(16)
    name = f"stoker_client_{os.getpid()}_{secrets.token_hex(16)}"
    path = os.path.join(_DEV_SHM, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return None
    try:
        os.write(fd, token)
    finally:
        os.close(fd)
    pid = os.getpid()
    atexit.register(lambda: _unlink(path) if os.getpid() == pid else None)
    return pb.SharedMemoryProbe(name=name, token=token)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def read_segment(name: str, out: np.ndarray) -> None:
    """Fill `out` (uint8) from the start of the server's segment `name`, in one copy."""
    if "/" in name or not name.startswith("stoker_"):
        raise ValueError(f"not a stoker segment name: {name!r}")
    fd = os.open(os.path.join(_DEV_SHM, name), os.O_RDONLY)
    try:
        view = memoryview(out).cast("B")  # type: ignore[arg-type]  # numpy: a buffer
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:
                raise EOFError(f"segment {name} ends at byte {done} of {len(view)}")
            done += n
    finally:
        os.close(fd)
