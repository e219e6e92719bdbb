"""Limits of the front end: descriptors, gRPC connections, open calls, held shared memory.

Every refusal names the limit's key and value (docs/security.md lists them all); the server
goes on serving everyone else. What each bounds:

- descriptors: `raise_nofile` lifts the soft RLIMIT_NOFILE to the hard one at start (workers
  inherit it), and `nofile_warning` says when the configured limits need more than that;
- gRPC connections: `grpc_options` (a connection cap, handshake and idle timeouts, streams per
  connection, keepalive: a silent client let go within silent_client_seconds), and
  `Admission.open`'s count of the connections one client address has calls on;
- calls held open: `Admission.open` counts batch streams and health watches, per client
  address and in all;
- shared memory: `Admission.hold` counts the bytes of batches built and not yet sent or
  released, per client address and in all (`HeldPool` gives them back).

HTTP connections are bounded in server/front/http.py, data-socket claims in
server/front/data_listener.py.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import resource
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health

from ..pool import shm
from ..pool.depth import DEPTH, KEEP_SEGMENTS
from .data_listener import MAX_CLAIMS

if TYPE_CHECKING:
    from .._config import ServerSettings
    from ..pool.layout import BuiltBatch
    from .transports.base import BatchOwner

log = logging.getLogger("stoker.server")

__all__ = ["Admission", "HeldPool", "Kind", "LimitedHealth", "Refused", "grpc_options",
           "held_cap", "nofile_warning", "raise_nofile"]

# Calls on one gRPC connection at once (HTTP/2 SETTINGS): more queue on the client. A loader
# holds one stream per server; this only bounds what one connection can make the server hold.
MAX_CONCURRENT_STREAMS = 128
# Descriptors besides the connection limits: the listening sockets, logs, pipes, the
# interpreter's own.
BASE_FDS = 64


def raise_nofile() -> tuple[int, int]:
    """Lift the soft RLIMIT_NOFILE to the hard limit (an unlimited hard limit: to the
    kernel's nr_open); returns (soft, hard) as they are afterwards. A limit that cannot be
    raised stays as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as e:
            log.warning("open files: cannot raise the soft limit %d to %d: %s", soft, target, e)
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def fds_needed(settings: ServerSettings) -> int:
    """About how many descriptors the configured limits may take at once."""
    per_worker = KEEP_SEGMENTS + DEPTH + 4  # segments, pipes
    return (settings.max_http_connections + settings.max_grpc_connections + MAX_CLAIMS
            + settings.max_streams + settings.worker_count * per_worker + BASE_FDS)


def nofile_warning(settings: ServerSettings, soft: int, hard: int) -> str | None:
    """A warning when the limits need more descriptors than this process may open (a host
    with a low hard limit must still start: it serves fewer connections)."""
    need = fds_needed(settings)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return None
    return (f"open files: the connection limits need about {need} descriptors "
            f"(max_http_connections={settings.max_http_connections}, "
            f"max_grpc_connections={settings.max_grpc_connections}, "
            f"max_streams={settings.max_streams}) but this process may open {soft} (hard limit "
            f"{hard}): raise it (docker run --ulimit nofile=65536; systemd LimitNOFILE=) or "
            "lower those limits")


def keepalive(settings: ServerSettings) -> tuple[float, float]:
    """(seconds without traffic before a keepalive ping, seconds the ping has to be
    answered) for silent_client_seconds: a quarter each. gRPC pings a connection once it has
    heard nothing for the first (a connection that heard something meanwhile waits one period
    more), and closes it when the answer does not come within the second; the kernel closes
    it sooner when what was sent goes unacknowledged that long (gRPC sets TCP_USER_TIMEOUT to
    the second). So a silent client is let go within 3/4 of silent_client_seconds, plus the
    time its streams take to end (server/front/session.py, close)."""
    quarter = settings.silent_client_seconds / 4
    return quarter, quarter


def grpc_options(settings: ServerSettings) -> list[tuple[str, Any]]:
    """The gRPC server options that bound connections. grpc.max_connection_age_ms stays
    unset: a batch stream lasts an epoch, and the GOAWAY at a connection's age (plus its
    grace) would cut it."""
    ping_after, answer_within = keepalive(settings)
    return [
        ("grpc.keepalive_time_ms", int(ping_after * 1000)),
        ("grpc.keepalive_timeout_ms", int(answer_within * 1000)),
        ("grpc.max_allowed_incoming_connections", settings.max_grpc_connections),
        ("grpc.server_handshake_timeout_ms", int(settings.grpc_handshake_timeout_seconds * 1000)),
        ("grpc.max_connection_idle_ms", int(settings.grpc_idle_seconds * 1000)),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
    ]


def concurrent_rpcs(settings: ServerSettings) -> int:
    """grpc.aio's maximum_concurrent_rpcs: a backstop above our own limits, which name
    themselves (gRPC's refusal names nothing); the unary calls get room too."""
    return settings.max_streams + settings.max_health_watches + 256


def held_cap(settings: ServerSettings) -> tuple[int, str]:
    """The shared memory streams may hold in all, and how it was chosen: max_held_bytes, or
    3/4 of /dev/shm if that is smaller (the workers' own segments need the rest)."""
    cap = int(settings.max_held_bytes)
    quarter3 = shm.capacity()[0] * 3 // 4  # 0 where /dev/shm cannot be read
    if 0 < quarter3 < cap:
        return quarter3, f"max_held_bytes={_size(quarter3)} (3/4 of /dev/shm)"
    return cap, f"max_held_bytes={_size(cap)}"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError


class Kind(enum.Enum):
    """What an admitted call is, for the limits it counts against."""

    STREAM = "streams"
    WATCH = "health watches"


class Refused(Exception):
    """A call over a limit: its status code, and a message naming the limit."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Admission:
    """Open calls and held shared memory, per client address and in all. One per server;
    used on the server's event loop only (no lock)."""

    def __init__(self, settings: ServerSettings) -> None:
        self._settings = settings
        self._open_of: collections.Counter[str] = collections.Counter()  # streams + watches
        # client -> its connections (peers: address and port) with calls open -> how many
        self._connections_of: dict[str, collections.Counter[str]] = {}
        self._open: collections.Counter[Kind] = collections.Counter()
        self._held_of: collections.Counter[str] = collections.Counter()
        self.held = 0
        self.held_cap, self.held_cap_says = held_cap(settings)

    @contextlib.contextmanager
    def open(self, client: str, kind: Kind, peer: str = "") -> Iterator[None]:
        """Count one call of `kind` from `client`, on its connection `peer` (the call's peer:
        address and port), while the block runs; Refused if over a limit: the client's own
        first (RESOURCE_EXHAUSTED: every server would say the same to this client), then
        the server's (streams: UNAVAILABLE, another server may have room)."""
        s = self._settings
        if self._open_of[client] >= s.max_streams_per_client:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"streams: this client has {self._open_of[client]} open, this server "
                          f"allows max_streams_per_client={s.max_streams_per_client}")
        connections = self._connections_of.get(client, collections.Counter())
        if peer not in connections and len(connections) >= s.max_grpc_connections_per_client:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"connections: this client has calls open on {len(connections)} "
                          "gRPC connections, this server allows "
                          f"max_grpc_connections_per_client={s.max_grpc_connections_per_client}"
                          "; open one channel per server and share it")
        if kind is Kind.STREAM and self._open[kind] >= s.max_streams:
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"streams: this server has {self._open[kind]} open, "
                          f"max_streams={s.max_streams}; ask another server")
        if kind is Kind.WATCH and self._open[kind] >= s.max_health_watches:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"health watches: this server has {self._open[kind]} open, "
                          f"max_health_watches={s.max_health_watches}")
        self._open_of[client] += 1
        self._open[kind] += 1
        self._connections_of[client] = connections
        connections[peer] += 1
        try:
            yield
        finally:
            self._open[kind] -= 1
            self._open_of[client] -= 1
            if not self._open_of[client]:
                del self._open_of[client]
            connections[peer] -= 1
            if not connections[peer]:
                del connections[peer]
            if not connections:
                self._connections_of.pop(client, None)

    def over(self, client: str, nbytes: int) -> str | None:
        """Why `client` may not hold `nbytes` more shared memory (None: it may)."""
        per_client = int(self._settings.max_held_bytes_per_client)
        mine = self._held_of[client]
        if mine + nbytes > per_client:
            return (f"this client's streams hold {_size(mine)} of shared memory, this server "
                    f"allows max_held_bytes_per_client={_size(per_client)}; release batches "
                    "or ask another server")
        if self.held + nbytes > self.held_cap:
            return (f"streams hold {_size(self.held)} of shared memory, this server allows "
                    f"{self.held_cap_says}; ask another server")
        return None

    def hold(self, client: str, nbytes: int) -> None:
        """`client` holds `nbytes` more (negative: fewer)."""
        self.held += nbytes
        self._held_of[client] += nbytes
        if self._held_of[client] <= 0:
            del self._held_of[client]


class HeldPool:
    """The worker pool as one stream's transport sees it: a batch handed back stops counting
    against the stream's client in `Admission`."""

    def __init__(self, pool: BatchOwner, admission: Admission, client: str) -> None:
        self._pool = pool
        self._admission = admission
        self._client = client

    def release(self, batch: BuiltBatch, reuse: bool = True) -> None:
        self._admission.hold(self._client, -batch.payload_bytes)
        self._pool.release(batch, reuse=reuse)


class LimitedHealth(health.aio.HealthServicer):
    """gRPC health whose Watch calls count against the same limits as batch streams: each is
    a call held open for its whole life. Check is unlimited (probes call it, briefly)."""

    def __init__(self, admission: Admission, client_of: Any) -> None:
        super().__init__()
        self._admission = admission
        self._client_of = client_of

    async def Watch(self, request: Any, context: Any) -> None:
        with contextlib.ExitStack() as admitted:
            try:
                admitted.enter_context(self._admission.open(
                    self._client_of(context.peer()), Kind.WATCH, context.peer()))
            except Refused as e:
                await context.abort(e.code, str(e))  # raises: the call ends here
            await super().Watch(request, context)
