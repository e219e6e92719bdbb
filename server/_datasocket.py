"""The data socket: batch payloads over a plain TCP connection beside the gRPC stream.

gRPC's Python data path reaches a fraction of what a plain socket carries (docs/benchmarks.md,
wire). A client may ask for a data socket in its stream's first message: the stream's first
frame then names this server's data port and a random 16-byte token; the client connects,
writes the token, and from then on each batch's frame carries only its header while the
payload bytes follow on the socket, in the same order, sent straight from the worker's
shared memory (`loop.sock_sendall`, no copy in Python). gRPC stays the control path:
credits, errors, ordering, failover. A token is good for one connection, for one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time

from ._listen import listen

log = logging.getLogger("stoker.server")

TOKEN_BYTES = 16
TOKEN_WAIT = 10.0  # seconds a new connection has to send its token
# Connections still owing their token, at most, in all and from one address: past either, the
# OLDEST such connection is closed. Strangers that connect and say nothing cannot pile up
# sockets, nor keep a real client out: it sends its token within milliseconds of connecting,
# so it is never the oldest (closing the newest instead left it waiting SOCKET_WAIT seconds).
MAX_CLAIMS = 256
MAX_CLAIMS_PER_HOST = 16
WARN_EVERY = 10.0  # seconds between two warnings about evicted claims


class DataSockets:
    """One listening socket per server; connections are matched to streams by token."""

    def __init__(self, host: str, port: int) -> None:
        self._listener = listen(host, port)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._pending: dict[bytes, asyncio.Future[socket.socket]] = {}
        self._task: asyncio.Task | None = None
        self._warned = -WARN_EVERY  # when an eviction was last logged (monotonic)
        # Connections sending their token, oldest first: (the peer's host, the connection).
        self._claims: dict[asyncio.Task, tuple[str, socket.socket]] = {}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._accept())

    def expect(self) -> tuple[bytes, asyncio.Future[socket.socket]]:
        """A fresh token and the future its connection will resolve."""
        token = secrets.token_bytes(TOKEN_BYTES)
        fut: asyncio.Future[socket.socket] = asyncio.get_running_loop().create_future()
        self._pending[token] = fut
        return token, fut

    def forget(self, token: bytes) -> None:
        fut = self._pending.pop(token, None)
        if fut is not None and not fut.done():
            fut.cancel()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, peer = await loop.sock_accept(self._listener)
            host = peer[0] if isinstance(peer, tuple) else str(peer)
            self._evict(host)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._claim(conn))
            self._claims[task] = (host, conn)
            task.add_done_callback(self._forget_claim)

    def _evict(self, host: str) -> None:
        """Make room for one more claim from `host`: cancel the oldest of its own past
        MAX_CLAIMS_PER_HOST, the oldest of all past MAX_CLAIMS (cancelled claims leave
        _claims only when their task ends, so those are skipped)."""
        live = [(t, h) for t, (h, _) in self._claims.items() if not t.cancelling()]
        mine = [t for t, h in live if h == host]
        victim = (mine[0] if len(mine) >= MAX_CLAIMS_PER_HOST
                  else live[0][0] if len(live) >= MAX_CLAIMS else None)
        if victim is None:
            return
        victim.cancel()
        if time.monotonic() - self._warned >= WARN_EVERY:
            self._warned = time.monotonic()
            log.warning("data socket: %d connections (%d from %s) have not sent a token yet; "
                        "closing the oldest (more may follow, unlogged for %.0f s)",
                        len(live), len(mine), host, WARN_EVERY)

    def _forget_claim(self, task: asyncio.Task) -> None:
        _, conn = self._claims.pop(task)
        if task.cancelled():  # evicted (perhaps before it ran), or the listener closed
            conn.close()

    async def _claim(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        token = b""
        try:
            async with asyncio.timeout(TOKEN_WAIT):
                while len(token) < TOKEN_BYTES:
                    more = await loop.sock_recv(conn, TOKEN_BYTES - len(token))
                    if not more:
                        break
                    token += more
        except (TimeoutError, OSError):
            pass
        fut = self._pending.pop(token, None)
        if fut is None or fut.done():
            conn.close()  # a stranger, or too late: it learns nothing
            return
        fut.set_result(conn)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._claims):
            task.cancel()
        for token in list(self._pending):
            self.forget(token)
        with contextlib.suppress(OSError):
            self._listener.close()
