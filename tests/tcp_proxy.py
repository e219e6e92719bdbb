"""A TCP fault proxy for tests: put it between a client and a server and break the path.

    proxy = TcpProxy(("127.0.0.1", server_port)).start()
    proxy.address                      # "127.0.0.1:PORT": give this to the client
    proxy.set("delay", seconds=0.05)   # every chunk waits this long before it is forwarded
    proxy.set("stall")                 # accept, forward nothing (held, not lost) until changed
    proxy.set("drop")                  # reset every open connection, reset new ones at once
    proxy.set("truncate", limit=1000)  # forward `limit` more bytes each way, then close
    proxy.set("pass")                  # forward everything again
    proxy.close()

Modes act on open connections and new ones alike. Bytes held by a stall are forwarded when
the stall ends, so a stall is a path that freezes, not one that loses data; "drop" and
"truncate" lose what was in flight, as a broken connection does. Threads, not asyncio: one
acceptor and two pumps per connection; waits are on Events, never sleeps.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Any

MODES = ("pass", "delay", "stall", "drop", "truncate")
CHUNK = 64 << 10


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a crashed peer or a middlebox does. SHUT_RD first: it
    wakes a pump blocked in recv() on this socket, whose syscall would otherwise keep the
    socket (and the RST) alive after close()."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


class _Connection:
    def __init__(self, proxy: TcpProxy, down: socket.socket, up: socket.socket) -> None:
        self.proxy, self.down, self.up = proxy, down, up
        self.budget = [proxy.limit, proxy.limit]  # bytes left each way under truncate
        self.closed = threading.Event()
        self.threads = [threading.Thread(target=self._pump, args=(down, up, 0), daemon=True,
                                         name="tcp-proxy-up"),
                        threading.Thread(target=self._pump, args=(up, down, 1), daemon=True,
                                         name="tcp-proxy-down")]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self, reset: bool = False) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for sock in (self.down, self.up):
            if reset:
                _reset(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
        self.proxy._forget(self)

    def _pump(self, src: socket.socket, dst: socket.socket, way: int) -> None:
        proxy = self.proxy
        try:
            while not self.closed.is_set():
                data = src.recv(CHUNK)
                if not data:
                    break
                mode = proxy.wait_while_stalled(self.closed)
                if self.closed.is_set():
                    return
                if mode == "drop":
                    self.close(reset=True)
                    return
                if mode == "delay" and proxy.closing.wait(proxy.delay):
                    return
                if mode == "truncate":
                    with proxy.lock:
                        keep = data[: max(self.budget[way], 0)]
                        self.budget[way] -= len(keep)
                    if keep:
                        dst.sendall(keep)
                    if len(keep) < len(data):
                        proxy.truncated += 1
                        self.close()
                        return
                    continue
                dst.sendall(data)
                proxy.forwarded[way] += len(data)
        except OSError:
            pass
        # One side finished (or failed): pass the end on, as TCP would.
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        if all(not t.is_alive() or t is threading.current_thread() for t in self.threads):
            self.close()


class TcpProxy:
    """Forwards host:port (port 0: a free one) to `target` (host, port) in the mode set by
    set()."""

    def __init__(self, target: tuple[str, int] | str, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        if isinstance(target, str):
            h, _, p = target.rpartition(":")
            target = (h.strip("[]"), int(p))
        self.target = target
        self.mode = "pass"
        self.delay = 0.0
        self.limit = 0
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.closing = threading.Event()
        self.accepted = 0
        self.refused = 0  # connections reset at once under "drop"
        self.truncated = 0  # connections cut under "truncate"
        self.forwarded = [0, 0]  # bytes client->server, server->client
        self._conns: set[_Connection] = set()
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self._thread = threading.Thread(target=self._accept, daemon=True, name="tcp-proxy")

    def start(self) -> TcpProxy:
        if not self._thread.is_alive() and not self.closing.is_set():
            self._thread.start()
        return self

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def connections(self) -> int:
        with self.lock:
            return len(self._conns)

    def set(self, mode: str, *, seconds: float = 0.0, limit: int = 0) -> None:
        """Switch mode: `seconds` for delay, `limit` (bytes each way) for truncate."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        with self.lock:
            self.mode, self.delay, self.limit = mode, seconds, limit
            conns = list(self._conns)
            for c in conns:
                c.budget = [limit, limit]
            self.changed.notify_all()
        if mode == "drop":
            for c in conns:
                c.close(reset=True)

    def wait_while_stalled(self, closed: threading.Event) -> str:
        with self.lock:
            while self.mode == "stall" and not closed.is_set() and not self.closing.is_set():
                self.changed.wait(0.5)  # also wakes on set(); the timeout notices close()
            return self.mode

    def close(self) -> None:
        self.closing.set()
        with self.lock:
            self.changed.notify_all()
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        for c in conns:
            c.close(reset=True)
        if self._thread.is_alive():
            self._thread.join(10)
        for c in conns:
            for t in c.threads:
                if t.is_alive() and t is not threading.current_thread():
                    t.join(10)

    def _forget(self, conn: _Connection) -> None:
        with self.lock:
            self._conns.discard(conn)

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            if self.closing.is_set():
                down.close()
                return
            self.accepted += 1
            if self.mode == "drop":
                self.refused += 1
                _reset(down)
                continue
            try:
                up = socket.create_connection(self.target, timeout=5)
                up.settimeout(None)
            except OSError:
                _reset(down)  # the server is not there: the client sees a reset
                continue
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, down, up)
            with self.lock:
                self._conns.add(conn)
            conn.start()
