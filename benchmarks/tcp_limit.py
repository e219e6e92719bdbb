"""The fastest raw TCP receiver a Python process can be on this machine: the wire scenario's
limit (issue 31). A part of the wire scenario (wire.py runs `fastest` before its server
starts, and its section of the page shows every way's figures), not a script of its own.

A sender process sendall()s chunks (memoryviews of one preallocated buffer) on a loopback
connection; this process receives them into one preallocated bytearray until EOF, in each of
these ways: chunk sizes 256 KiB .. 16 MiB (the sender's and the receiver's call alike);
recv_into, recv_into with MSG_WAITALL (a whole chunk per call, as the wire scenario's
per-batch baseline), recvmsg_into; the listening socket's SO_RCVBUF left to the kernel or set
to 8 MiB. GB/s (10^9 bytes/s) over everything after the first chunk; medians over repeats;
the fastest way is the limit the wire scenario's ratios are taken against: it measures that
way again beside each batch size, in every repeat, and divides by its median there.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from itertools import product
from typing import Any

import numpy as np

CHUNKS = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
METHODS = ("recv_into", "recv_into_waitall", "recvmsg_into")
RCVBUFS = (0, 8 << 20)  # 0: the kernel's default (autotuned)


def _sender(port: int, chunk: int, chunks: int) -> None:
    view = memoryview((np.arange(chunk, dtype=np.int64) % 251).astype(np.uint8))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(chunks):
            sock.sendall(view)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # until the receiver has it all and closes


def _receive(conn: socket.socket, view: memoryview, method: str) -> int:
    """Bytes received until EOF, into `view` over and over."""
    total = 0
    if method == "recvmsg_into":
        while n := conn.recvmsg_into([view])[0]:
            total += n
    else:
        flags = socket.MSG_WAITALL if method == "recv_into_waitall" else 0
        while n := conn.recv_into(view, 0, flags):
            total += n
    return total


def measure(ctx: Any, chunk: int, method: str, rcvbuf: int, total: int) -> float:
    """GB/s of one transfer of `total` bytes (at least 4 chunks), the first chunk untimed."""
    chunks = max(4, total // chunk)
    view = memoryview(bytearray(chunk))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        if rcvbuf:  # before listen(): the accepted socket inherits it, window scaling too
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(60)
        sender = ctx.Process(target=_sender, args=(listener.getsockname()[1], chunk, chunks),
                             daemon=True)
        sender.start()
        try:
            conn = listener.accept()[0]
            with conn:
                first = conn.recv_into(view, chunk, socket.MSG_WAITALL)
                t0 = time.perf_counter()
                rest = _receive(conn, view, method)
                seconds = time.perf_counter() - t0
        finally:
            sender.join(timeout=30)
            if sender.is_alive():
                sender.kill()
    if first + rest != chunks * chunk:
        raise RuntimeError(f"{method} {chunk}: received {first + rest} of {chunks * chunk} bytes")
    return rest / seconds / 1e9


def fastest(total: int, repeats: int, ctx: Any | None = None) -> dict[str, Any]:
    """Every way, `repeats` times (interleaved), medians, and the fastest."""
    ctx = ctx or mp.get_context("spawn")
    ways = list(product(CHUNKS, METHODS, RCVBUFS))
    runs: dict[tuple[int, str, int], list[float]] = {w: [] for w in ways}
    for _ in range(repeats):
        for w in ways:
            runs[w].append(measure(ctx, *w, total))
    rows = [{"chunk": c, "method": m, "rcvbuf": b, "gb_per_s": float(np.median(runs[(c, m, b)])),
             "repeats": runs[(c, m, b)]} for c, m, b in ways]
    best = max(rows, key=lambda r: r["gb_per_s"])
    return {"ways": rows, "best": best, "label": label(best), "bytes_per_way": total,
            "repeats": repeats}


def fastest_again(limit: dict[str, Any], ctx: Any, plan: dict[str, int]) -> float:
    """GB/s of the way `fastest` found, moving what one repeat of a wire size moves (at
    least 4 chunks)."""
    best = limit["best"]
    moved = plan["timed_batches"] * plan["payload_bytes"]
    return measure(ctx, best["chunk"], best["method"], best["rcvbuf"], moved)


def label(row: dict[str, Any]) -> str:
    buf = f"SO_RCVBUF {row['rcvbuf'] >> 20} MiB" if row["rcvbuf"] else "default SO_RCVBUF"
    return f"{row['method']}, {row['chunk'] >> 10} KiB a call, {buf}"
