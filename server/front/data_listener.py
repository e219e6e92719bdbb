"""The data connection: a stream's batches over a TCP connection of their own, beside gRPC.

gRPC's Python data path reaches a fraction of what a plain socket carries (docs/benchmarks.md,
wire). A client asks for a data connection in its stream's first message: the stream's first
frame then names this server's data port and a random 16-byte token; the client connects
(TLS when the server has `server.tls`: the same certificate and key, and a client
certificate required when the gRPC port requires one), writes its claim, and from then on
reads every answer of the stream from that connection (server/front/transports/datasocket.py).
gRPC stays the control path: credits, errors of the call, failover.

The claim (its bytes: stoker.v1.wire) is the token, followed, when the stream's caller holds
a bearer token, by HMAC-SHA256(key = that bearer token, message = the token): the token alone
only ever went out on an authenticated stream, and the proof shows the connection's owner
holds the same bearer token as well. Under grants (front/grants.py) the key is the stream's
own grant's token, and a stream granted by a client certificate needs a data connection with
a certificate of the same grant. A token is good for one connection, for one stream; a
connection whose claim does not match is closed having been sent nothing.

Strangers (issue 41): a connection has CLAIM_WAIT seconds to send its claim, then it is
closed; at most MAX_CLAIMS_PER_HOST claims wait from one address and MAX_CLAIMS in all, and
past either the OLDEST waiting one is closed at once. A real client claims within
milliseconds of connecting, so silent connections from its own address or any other do not
keep it off its data connection. While MAX_CLAIMS claims wait at once (many addresses), new
streams are offered no data connection (`saturated`): they get frames at once instead of
waiting SOCKET_WAIT for a connection that may be evicted. Metrics:
stoker_data_claims_dropped_total{reason="per_address"|"total"|"late"|"wrong"}.
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
from collections.abc import Callable
from dataclasses import dataclass

from stoker.v1.wire import PROOF_BYTES, TOKEN_BYTES, claim_token

from .grants import OPEN, Grant, Identity
from .listen import listen

log = logging.getLogger("stoker.server")

# Seconds a new connection has to send its claim (and finish its TLS handshake): a real
# client sends it at once, on a connection it opened because its stream was just offered it.
CLAIM_WAIT = 3.0
TOKEN_WAIT = CLAIM_WAIT  # the name older tests and docs use
# Connections still owing their token, at most, in all and from one address: past either, the
# OLDEST such connection is closed. Strangers that connect and say nothing cannot pile up
# sockets, nor keep a real client out: it sends its token within milliseconds of connecting,
# so it is never the oldest (closing the newest instead left it waiting SOCKET_WAIT seconds).
MAX_CLAIMS = 256
MAX_CLAIMS_PER_HOST = 16
WARN_EVERY = 10.0  # seconds between two warnings about evicted claims


@dataclass
class _Expected:
    """A stream's offer, until its connection claims it."""

    connection: asyncio.Future[socket.socket | None]
    grant: Grant


class DataSockets:
    """One listening socket per server; connections are matched to streams by token.

    `tls`: connections are TLS (their handshake and claim run on a thread of their own, one
    per connection still claiming, at most MAX_CLAIMS; the connection a stream gets is then a
    blocking ssl.SSLSocket). Each stream's offer (`expect`) names the grant whose credential
    its claim must prove. Runs on the server's event loop (TLS handshakes: threads that
    hand their result back to it)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls
        # Called with the reason of each connection closed unclaimed (the metrics count it).
        self.on_dropped: Callable[[str], None] = lambda reason: None
        self._listener = listen(host, port)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._pending: dict[bytes, _Expected] = {}
        self._task: asyncio.Task | None = None
        self._warned = -WARN_EVERY  # when an eviction was last logged (monotonic)
        # Connections sending their token, oldest first: (the peer's host, [the connection]:
        # its TLS wrapper once the handshake thread made one).
        self._claims: dict[asyncio.Task, tuple[str, list[socket.socket]]] = {}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._accept())

    def expect(self, grant: Grant = OPEN) -> tuple[bytes, asyncio.Future[socket.socket | None]]:
        """A fresh token and the future its connection (None: unreachable) will resolve; its
        claim must prove `grant`'s credential."""
        token = secrets.token_bytes(TOKEN_BYTES)
        fut: asyncio.Future[socket.socket | None] = asyncio.get_running_loop().create_future()
        self._pending[token] = _Expected(fut, grant)
        return token, fut

    @property
    def credits(self) -> bool:
        """Streams read credits on their connections: plain TCP only (a TLS connection is
        a blocking ssl.SSLSocket written by a thread; an SSL object is not read and written
        from two threads at once)."""
        return self._tls is None

    @property
    def tls(self) -> bool:
        return self._tls is not None

    max_claims, max_claims_per_host = MAX_CLAIMS, MAX_CLAIMS_PER_HOST

    @property
    def waiting(self) -> int:
        """Connections still owing their claim (evicted ones until their task ends)."""
        return len(self._claims)

    @property
    def saturated(self) -> bool:
        """MAX_CLAIMS connections wait to claim at once: a new claim would evict another."""
        return sum(1 for t in self._claims if not t.cancelling()) >= MAX_CLAIMS

    def unreachable(self, token: bytes) -> None:
        """The client says it cannot connect: `token`'s future resolves to None at once."""
        expected = self._pending.pop(token, None)
        if expected is not None and not expected.connection.done():
            expected.connection.set_result(None)

    def forget(self, token: bytes) -> None:
        expected = self._pending.pop(token, None)
        if expected is not None and not expected.connection.done():
            expected.connection.cancel()

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
        if len(mine) >= MAX_CLAIMS_PER_HOST:
            victim, reason = mine[0], "per_address"
        elif len(live) >= MAX_CLAIMS:
            victim, reason = live[0][0], "total"
        else:
            return
        victim.cancel()
        self.on_dropped(reason)
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

    def _proof_wanted(self, token: bytes) -> bool:
        """Whether the claim of `token` goes on with a proof (a dict read: safe from the
        handshake threads)."""
        expected = self._pending.get(token)
        return expected is not None and expected.grant.token is not None

    async def _claim(self, box: list[socket.socket]) -> None:
        loop = asyncio.get_running_loop()
        conn = box[0]
        identity: Identity | None = None
        if self._tls is None:
            claim = b""
            found: socket.socket | None = conn
            try:
                async with asyncio.timeout(CLAIM_WAIT):
                    want = TOKEN_BYTES
                    while len(claim) < want:
                        more = await loop.sock_recv(conn, want - len(claim))
                        if not more:
                            break
                        claim += more
                        if len(claim) == TOKEN_BYTES and self._proof_wanted(claim):
                            want += PROOF_BYTES
            except (TimeoutError, OSError):
                self.on_dropped("late")
                found = None
        else:
            # The handshake blocks: on a thread, whose result comes back to the loop. If this
            # task is cancelled (evicted, closing), _forget_claim closes `conn` and the thread
            # ends on the error.
            done: asyncio.Future[tuple[socket.socket | None, bytes, Identity | None]] = (
                loop.create_future())

            def handshake() -> None:
                result: tuple[socket.socket | None, bytes, Identity | None] = (None, b"", None)
                try:
                    conn.setblocking(True)
                    conn.settimeout(CLAIM_WAIT)
                    assert self._tls is not None
                    wrapped = self._tls.wrap_socket(conn, server_side=True,
                                                    do_handshake_on_connect=False)
                    box[0] = wrapped  # what eviction closes from now on
                    wrapped.do_handshake()
                    got, want = b"", TOKEN_BYTES
                    while len(got) < want:
                        more = wrapped.recv(want - len(got))
                        if not more:
                            break
                        got += more
                        if len(got) == TOKEN_BYTES and self._proof_wanted(got):
                            want += PROOF_BYTES
                    wrapped.settimeout(None)
                    result = (wrapped, got, Identity.of_ssl(wrapped.getpeercert()))
                except (OSError, ValueError):
                    pass
                def settle() -> None:  # on the loop: the waiter may have given up
                    if not done.done():
                        done.set_result(result)

                with contextlib.suppress(RuntimeError):  # the loop has closed
                    loop.call_soon_threadsafe(settle)

            threading.Thread(target=handshake, name="stoker-data-tls", daemon=True).start()
            found, claim, identity = await done
        expected = self._pending.get(claim[:TOKEN_BYTES])
        if found is None or expected is None or expected.connection.done() or not _proves(
                claim, expected.grant, identity):
            if found is not None:
                self.on_dropped("wrong")
            box[0].close()  # a stranger, or too late: it learns nothing
            return
        del self._pending[claim[:TOKEN_BYTES]]
        expected.connection.set_result(found)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._claims):
            task.cancel()
        for token in list(self._pending):
            self.forget(token)
        with contextlib.suppress(OSError):
            self._listener.close()


def _proves(claim: bytes, grant: Grant, identity: Identity | None) -> bool:
    """Whether `claim` (and the connection's certificate) proves `grant`'s credential: its
    bearer token's proof (constant time), and for a certificate's grant the same identity."""
    if claim_token(claim, grant.token) is None:
        return False
    if grant.client_cert is not None and grant.token is None:
        return identity is not None and identity.matches(grant.client_cert)
    return True
