"""The data connection: a stream's batches over a TCP connection of their own, beside gRPC.

gRPC's Python data path reaches a fraction of what a plain socket carries (docs/benchmarks.md,
wire). A client asks for a data connection in its stream's first message: the stream's first
frame then names this server's data port and a random 16-byte token; the client connects
(TLS when the server has `server.tls`: the same certificate and key, and a client
certificate required when the gRPC port requires one), writes its claim, and from then on
reads every answer of the stream from that connection (server/front/transports/datasocket.py).
gRPC stays the control path: credits, errors of the call, failover.

The claim (its bytes: stoker.v1.wire) is the token, followed, when the server checks a
bearer token, by HMAC-SHA256(key = bearer token, message = the token): the token alone only
ever went out on an authenticated stream, and the proof shows the connection's owner holds
the bearer token as well. A token is good for one connection, for one stream; a connection
whose claim does not match is closed having been sent nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import ssl
import threading
import time

from stoker.v1.wire import TOKEN_BYTES, claim_length, claim_token

from .listen import listen

log = logging.getLogger("stoker.server")

TOKEN_WAIT = 10.0  # seconds a new connection has to send its token
# Connections still owing their token, at most, in all and from one address: past either, the
# OLDEST such connection is closed. Strangers that connect and say nothing cannot pile up
# sockets, nor keep a real client out: it sends its token within milliseconds of connecting,
# so it is never the oldest (closing the newest instead left it waiting SOCKET_WAIT seconds).
MAX_CLAIMS = 256
MAX_CLAIMS_PER_HOST = 16
WARN_EVERY = 10.0  # seconds between two warnings about evicted claims


class DataSockets:
    """One listening socket per server; connections are matched to streams by token.

    `tls`: connections are TLS (their handshake and claim run on a thread of their own, one
    per connection still claiming, at most MAX_CLAIMS; the connection a stream gets is then a
    blocking ssl.SSLSocket). `bearer`: claims carry the proof of this bearer token."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None = None,
                 bearer: bytes | None = None) -> None:
        self._tls = tls
        self._bearer = bearer
        self._listener = listen(host, port)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._pending: dict[bytes, asyncio.Future[socket.socket | None]] = {}
        self._task: asyncio.Task | None = None
        self._warned = -WARN_EVERY  # when an eviction was last logged (monotonic)
        # Connections sending their token, oldest first: (the peer's host, [the connection]:
        # its TLS wrapper once the handshake thread made one).
        self._claims: dict[asyncio.Task, tuple[str, list[socket.socket]]] = {}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._accept())

    def expect(self) -> tuple[bytes, asyncio.Future[socket.socket | None]]:
        """A fresh token and the future its connection (None: unreachable) will resolve."""
        token = secrets.token_bytes(TOKEN_BYTES)
        fut: asyncio.Future[socket.socket | None] = asyncio.get_running_loop().create_future()
        self._pending[token] = fut
        return token, fut

    @property
    def credits(self) -> bool:
        """Streams read credits on their connections: plain TCP only (a TLS connection is
        a blocking ssl.SSLSocket written by a thread; an SSL object is not read and written
        from two threads at once)."""
        return self._tls is None

    @property
    def proof(self) -> bool:
        """Claims carry a proof of the bearer token."""
        return self._bearer is not None

    def unreachable(self, token: bytes) -> None:
        """The client says it cannot connect: `token`'s future resolves to None at once."""
        fut = self._pending.pop(token, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

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
            box = [conn]
            task = loop.create_task(self._claim(box))
            self._claims[task] = (host, box)
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
        _, box = self._claims.pop(task)
        if task.cancelled():  # evicted (perhaps before it ran), or the listener closed
            with contextlib.suppress(OSError):  # a handshake thread blocked on it returns
                box[0].shutdown(socket.SHUT_RDWR)
            box[0].close()

    async def _claim(self, box: list[socket.socket]) -> None:
        loop = asyncio.get_running_loop()
        conn = box[0]
        want = claim_length(self._bearer is not None)
        if self._tls is None:
            claim = b""
            try:
                async with asyncio.timeout(TOKEN_WAIT):
                    while len(claim) < want:
                        more = await loop.sock_recv(conn, want - len(claim))
                        if not more:
                            break
                        claim += more
            except (TimeoutError, OSError):
                pass
            found: socket.socket | None = conn
        else:
            # The handshake blocks: on a thread, whose result comes back to the loop. If this
            # task is cancelled (evicted, closing), _forget_claim closes `conn` and the thread
            # ends on the error.
            done: asyncio.Future[tuple[socket.socket | None, bytes]] = loop.create_future()

            def handshake() -> None:
                result: tuple[socket.socket | None, bytes] = (None, b"")
                try:
                    conn.setblocking(True)
                    conn.settimeout(TOKEN_WAIT)
                    assert self._tls is not None
                    wrapped = self._tls.wrap_socket(conn, server_side=True,
                                                    do_handshake_on_connect=False)
                    box[0] = wrapped  # what eviction closes from now on
                    wrapped.do_handshake()
                    got = b""
                    while len(got) < want:
                        more = wrapped.recv(want - len(got))
                        if not more:
                            break
                        got += more
                    wrapped.settimeout(None)
                    result = (wrapped, got)
                except (OSError, ValueError):
                    pass
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    loop.call_soon_threadsafe(
                        lambda: done.done() or done.set_result(result))

            threading.Thread(target=handshake, name="stoker-data-tls", daemon=True).start()
            found, claim = await done
        # A claim cut short, or the right token without the bearer token's proof: a stranger.
        token = claim_token(claim, self._bearer)
        fut = self._pending.get(token) if token is not None else None
        if fut is None or fut.done() or found is None:
            box[0].close()  # a stranger, or too late: it learns nothing
            return
        del self._pending[token]
        fut.set_result(found)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._claims):
            task.cancel()
        for token in list(self._pending):
            self.forget(token)
        with contextlib.suppress(OSError):
            self._listener.close()
