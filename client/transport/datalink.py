"""The client's end of the data connection: connecting within a budget, and what it used.

A stream offered a data connection (server/front/data_listener.py) connects to the server's data
port with the loader's own security: TLS with the root certificates, client certificate and server
name it gives gRPC (the server's name checked as gRPC checks it), and, when the server asks,
the proof of the bearer token after the claim token. Connecting, the TLS handshake and the
claim together get CONNECT_BUDGET seconds: a data port behind a firewall costs at most that
before the stream says so and the server sends in gRPC frames instead.

Threading: DataLink is immutable; Transports is locked (receive threads note, any thread
reads).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.v1 import stoker_pb2 as pb
from stoker.v1.wire import encode_claim

log = logging.getLogger("stoker.client")

# Seconds from the offer to the decision: connected and claimed, or frames.
CONNECT_BUDGET = 0.5
# Socket buffer asked for on the data connection: a few large records in flight. Only where
# the kernel grants it (net.core.rmem_max): a size set by hand also turns off Linux's
# receive-buffer autotuning, and capped at a stock rmem_max (208 KiB) it would hold a link
# between machines to less than autotuning gives it.
RCVBUF = 4 << 20


def _rmem_max() -> int:
    try:
        with open("/proc/sys/net/core/rmem_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0  # not Linux, or not readable: leave the buffer to the system


SET_RCVBUF = _rmem_max() >= RCVBUF


def client_context(tls: bool | Mapping[str, Any] | None) -> ssl.SSLContext | None:
    """The data connection's TLS context for a loader's `tls` argument (checked already by
    _channel.credentials): system roots, or tls['ca']; tls['cert'] and tls['key'] presented."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return ssl.create_default_context()
    def path(key: str) -> str | None:  # as _channel reads them: `~` is the home folder
        return None if tls.get(key) is None else str(Path(tls[key]).expanduser())

    context = ssl.create_default_context(cafile=path("ca"))
    if (cert := path("cert")) is not None:
        context.load_cert_chain(cert, path("key"))
    return context


@dataclass(frozen=True)
class DataLink:
    """How a loader's streams connect to a data port (tls None: plain TCP)."""

    tls: ssl.SSLContext | None = None
    server_name: str | None = None  # the name the certificate must carry; None: the host
    bearer: str | None = None  # the loader's bearer token, for the claim's proof

    def connect(self, host: str, offer: pb.DataSocket,
                budget: float = CONNECT_BUDGET) -> socket.socket:
        """A connection to `host`'s data port, claimed for the offering stream, blocking;
        OSError (ssl.SSLError and certificate errors included) if that took over `budget`
        seconds or failed."""
        deadline = time.monotonic() + budget
        sock = socket.create_connection((host, offer.port), timeout=budget)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if SET_RCVBUF:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            bearer = None  # the claim's proof: only where the server asks for it
            if offer.proof:
                if self.bearer is None:
                    raise OSError("the server wants the bearer token's proof and this "
                                  "loader has no token")
                bearer = self.bearer.encode()
            claim = encode_claim(offer.token, bearer)
            if self.tls is not None:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock = self.tls.wrap_socket(sock, server_hostname=self.server_name or host)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(claim)
            sock.settimeout(None)  # a stalled server is the scheduler's to judge
        except BaseException:
            sock.close()
            raise
        return sock


class Transports:
    """How each server's batches reached one loader, and why: stats()["transport"] (the
    latest stream's) and stats()["transports"] (by address). The first fallback is logged
    once, as a WARNING."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[str, dict[str, str]] = {}
        self._latest = ""
        self._warned = False

    def note(self, address: str, transport: str, why: str, warn: bool = False) -> None:
        with self._lock:
            self._by[address] = {"transport": transport, "why": why}
            self._latest = transport
            warn, self._warned = warn and not self._warned, self._warned or warn
        if warn:
            log.warning("%s: batches come in gRPC frames: %s (said once per loader; "
                        "stats()['transports'] names each server's path)", address, why)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"transport": self._latest,
                    "transports": {a: dict(v) for a, v in sorted(self._by.items())}}
