"""The data servers a loader may use: their addresses, channels and health as seen from here.

Addresses are "host:port" strings, or one "dns:///name:port" target whose A/AAAA records are
the servers (a Kubernetes headless service, `docker compose --scale`); it is re-resolved
every `dns_refresh` seconds (RESOLVE_EVERY by default), so servers added later are used and
removed ones drained. A `Resolver` replaces the system's DNS for such a target: a service
registry, or a file of addresses that a local autoscaler writes (`stoker autoscale`).
"""

from __future__ import annotations

import concurrent.futures
import enum
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from ..transport.stream import BatchStream
from .rates import Rate

RESOLVE_EVERY = 15.0  # seconds between resolutions of a dns: target, by default
BACKOFF_FIRST, BACKOFF_MAX = 0.05, 2.0  # seconds before a failed server is tried again
DRAIN_RETRY = 1.0  # seconds before a server that drained is tried again
# Seconds after a stall (and after the last credit) before a stalled server is given a probe
# credit: its host may have lost its network and found it again (a partition that healed),
# and only a batch delivered says so. One probe at a time beyond what it held when it
# stalled (so a server that wakes up never finds more credits than a window's: max_credits);
# its index is asked of an up server too, at once.
PROBE_EVERY = 2.0
# Seconds a refresh waits for its look-up before the loop goes on without it. Look-ups run
# on a thread of their own: a DNS server that answers in seconds, or not at all (the system
# resolver's timeouts are 5 s a try), would otherwise hold the training loop (and, under the
# scheduler's lock, every stream's delivery) that long every dns_refresh seconds. A look-up
# still running is used by the first refresh after it ends; none other starts meanwhile.
RESOLVE_WAIT = 0.05

# Servers send frames of at most 32 MiB (server config limit); leave room for the header.
# Keepalive pings notice a server that stopped answering (frozen, or its host gone) even
# while a stream waits quietly for a batch.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 4 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect quickly after a restart: the scheduler does its own backoff between tries.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclass(frozen=True)
class Fleet:
    """What the servers in use can do together: worker processes, the samples/s they build
    (0.0: not measured yet), and the mean seconds from a credit to its batch (None: no
    batch yet)."""

    workers: int
    samples_per_second: float
    latency: float | None


class ServerState(enum.Enum):
    """A server as the scheduler sees it; the value is what stats() and errors show."""

    UP = "up"  # takes credits
    DOWN = "down"  # its stream failed or it drained: no credits until retry_at
    DRAINING = "draining"  # refused a credit in-band: no new credits, finishes what it holds
    STALLED = "stalled"  # held credits without delivering: a probe credit every PROBE_EVERY
    GONE = "gone"  # its dns name no longer lists it: no new credits


@dataclass(eq=False)
class Server:
    """One server. Fields are guarded by the scheduler's lock; call the mark_* transitions
    under it too. `streams`: one open stream per epoch it has credits of (the loop's, and
    the next one's first batches, asked for while the loop ends its epoch)."""

    address: str
    channel: grpc.Channel
    streams: dict[int, BatchStream] = field(default_factory=dict)
    outstanding: dict[int, float] = field(default_factory=dict)  # batch index -> credited at
    state: ServerState = ServerState.UP
    retry_at: float = 0.0
    backoff: float = BACKOFF_FIRST
    last_error: str = ""
    refused: str = ""  # the last in-band UNAVAILABLE's message (draining, storage outage)
    latency: float | None = None  # seconds from credit to batch, moving average
    # What it said it can do (Describe, a stream's metadata): workers, and samples/s they
    # build (0.0: not measured yet); None: it has not said.
    capacity: tuple[int, float] | None = None
    last_progress: float = 0.0
    batches: int = 0
    errors: int = 0
    rate: Rate = field(default_factory=Rate)  # what it delivers per busy second
    hedged: int = 0  # its batches also asked of a faster server because it was late
    # Its answer to the loader's first Describe (client/contact/agreement.py), while it has not
    # come: no credits until it does (an address that black-holes must not hold the first
    # batches).
    contact: grpc.Future | None = None
    held_at_stall: int = 0  # credits it held when it stalled (see PROBE_EVERY)

    @property
    def up(self) -> bool:
        return self.state is ServerState.UP

    def usable(self, now: float) -> bool:
        if self.contact is not None and not self.contact.done():
            return False
        if self.state is ServerState.STALLED:  # a probe: see PROBE_EVERY
            if len(self.outstanding) > self.held_at_stall:
                return False
            last = max(self.outstanding.values(), default=self.retry_at - PROBE_EVERY)
            return now >= max(self.retry_at, last + PROBE_EVERY)
        return self.up or (self.state is ServerState.DOWN and now >= self.retry_at)

    def record_latency(self, seconds: float) -> None:
        self.latency = seconds if self.latency is None else 0.8 * self.latency + 0.2 * seconds

    # -- transitions -----------------------------------------------------------------------
    def mark_up(self, epoch: int, stream: BatchStream) -> None:
        """A new stream, for `epoch`, is open to it (it was usable: up, or down and due for
        a retry, or stalled and due for a probe). A stalled server stays stalled: a stream
        opened for its probe (the epoch it stalled in was let go) is no sign of life; it is
        up again when it delivers (mark_delivered)."""
        if self.state is not ServerState.STALLED:
            self.state = ServerState.UP
        self.streams[epoch] = stream

    def let_go(self) -> list[BatchStream]:
        """Forget its streams; the caller closes those still open."""
        streams, self.streams = list(self.streams.values()), {}
        return streams

    def mark_stalled(self, now: float) -> None:
        """It held credits and delivered nothing for a while: others are asked for what it
        holds, and from PROBE_EVERY s on it gets a probe credit (one at a time) until it
        delivers."""
        self.state = ServerState.STALLED
        self.retry_at = now + PROBE_EVERY
        self.held_at_stall = len(self.outstanding)
        self.rate.forget()  # the time it stalled is no measure of its rate

    def mark_delivered(self, index: int, now: float) -> None:
        """Its stream answered `index` (a batch or an in-band error): it is alive."""
        asked = self.outstanding.pop(index, None)
        if asked is not None:
            self.record_latency(now - asked)
        self.last_progress = now
        self.backoff = BACKOFF_FIRST
        if self.state is ServerState.STALLED:
            self.state = ServerState.UP

    # A gone server stays gone whatever its stream does (a server taken off its name is
    # usually drained next): only its name listing it again brings it back (mark_back).
    def _down(self) -> ServerState:
        return ServerState.GONE if self.state is ServerState.GONE else ServerState.DOWN

    def mark_draining(self, reason: str = "") -> None:
        if self.state is not ServerState.GONE:
            self.state = ServerState.DRAINING
        self.refused = reason or self.refused

    def mark_drained(self, now: float) -> None:
        """Done with what it took while draining: the caller lets go of its streams (let_go)
        and closes them; try it again after DRAIN_RETRY (it may be restarting)."""
        self.state = self._down()
        self.retry_at, self.last_error = now + DRAIN_RETRY, "draining"
        self.rate.forget()

    def mark_down(self, error: Any, now: float) -> None:
        """A stream of it failed (the caller lets go of them all: let_go): try it again
        after the backoff, which doubles each time."""
        self.state = self._down()
        self.rate.forget()
        self.last_error = str(error)
        self.errors += 1
        self.retry_at = now + self.backoff
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)

    def mark_gone(self) -> None:
        self.state = ServerState.GONE

    def mark_back(self) -> None:
        """Its dns name lists it again."""
        if self.state is ServerState.GONE:
            self.state = ServerState.UP

    def stats(self) -> dict[str, Any]:
        return {"state": self.state.value, "batches": self.batches, "errors": self.errors,
                "latency_seconds": self.latency, "outstanding": len(self.outstanding),
                "batches_per_second": self.rate.batches_per_second,
                "bytes_per_second": self.rate.bytes_per_second, "hedged": self.hedged,
                "last_error": self.last_error}


def parse_addresses(address: str | Sequence[str]) -> tuple[list[str], str | None]:
    """(fixed addresses, dns target or None)."""
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise ValueError("address: give at least one 'host:port' or 'dns:///name:port'")
    dns = [a for a in addresses if a.startswith("dns:")]
    if dns and len(addresses) > 1:
        raise ValueError(f"address: a dns: target stands alone, got {addresses}")
    for a in addresses:
        host, sep, port = a.removeprefix("dns:///").removeprefix("dns:").rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address: expected 'host:port' or 'dns:///name:port', got {a!r}")
    return (addresses, None) if not dns else ([], dns[0])


# resolver(target) -> the "host:port" addresses a "dns:///name:port" target names now. It
# runs on a thread of its own (see RESOLVE_WAIT), one call at a time. OSError means "cannot
# tell now" (the servers known stay); other exceptions reach the loop.
Resolver = Callable[[str], Sequence[str]]


def resolve(target: str) -> list[str]:
    """The "ip:port" addresses a dns:///name:port target names now (sorted, deduplicated),
    from the system's resolver: the default `Resolver`."""
    host, _, port = target.removeprefix("dns:///").removeprefix("dns:").rpartition(":")
    infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    found = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        found.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(found)


class ServerSet:
    """The current servers; re-resolves a dns target now and then. Not thread-safe: the
    scheduler calls it under its lock."""

    def __init__(self, address: str | Sequence[str],
                 channel: Callable[[str, list[tuple[str, Any]]], grpc.Channel] | None = None,
                 *, dns_refresh: float = RESOLVE_EVERY, resolver: Resolver | None = None
                 ) -> None:
        """`channel(address, options)` makes a server's channel (TLS, token: channel.py);
        default: plain TCP. A dns: target is resolved by `resolver` (default: the system's)
        every `dns_refresh` seconds; ValueError if either is given wrong."""
        self._fixed, self._dns = parse_addresses(address)
        if not (isinstance(dns_refresh, (int, float)) and dns_refresh > 0):
            raise ValueError(f"dns_refresh must be > 0 seconds, got {dns_refresh!r}")
        if resolver is not None and self._dns is None:
            raise ValueError(f"resolver applies to a 'dns:///name:port' address, got "
                             f"{self._fixed}")
        if resolver is not None and not callable(resolver):
            raise ValueError(f"resolver must be a callable(target) -> ['host:port', ...], "
                             f"got {resolver!r}")
        self._channel = channel or (lambda a, o: grpc.insecure_channel(a, options=o))
        self._resolver = resolver or resolve
        self._every = float(dns_refresh)
        self.servers: dict[str, Server] = {}
        self._lookup: concurrent.futures.Future[list[str]] | None = None  # one at a time
        self._resolved_at: float | None = -self._every
        self.refresh(time.monotonic(), wait=None)  # the first servers: however long it takes
        # The first refresh() by the caller's clock (the scheduler's, which a test may drive)
        # resolves again and starts the period on that clock.
        self._resolved_at = None

    def describe(self) -> str:
        return self._dns or ", ".join(self._fixed)

    def now(self) -> str:
        """Every server, its state and last error (for errors and log lines)."""
        return "; ".join(
            f"{s.address}: {s.state.value}, last error: {s.last_error or 'none'}"
            + (f", last refusal: {s.refused}" if s.refused else "")
            for s in self.servers.values())

    def refresh(self, now: float, wait: float | None = RESOLVE_WAIT) -> None:
        """Resolve the dns target if due (waiting at most `wait` seconds for the look-up;
        None: until it ends); let go of gone servers that hold nothing."""
        if self._dns is None and self.servers:
            return  # a fixed list: made once, and none of it ever gone (called per batch)
        for server in self.servers.values():
            if server.state is ServerState.GONE and server.streams \
                    and not server.outstanding:
                # Off the name and done with what it held: close our streams now, so that
                # its drain (a pod taken off a Service, then SIGTERM) need not wait for us.
                for stream in server.let_go():
                    stream.close(wait=False)
        if self._dns is None:
            wanted = self._fixed
        else:
            started = self._lookup is None and (self._resolved_at is None
                                                or now - self._resolved_at >= self._every)
            if started:
                self._resolved_at = now
                self._lookup = self._start_lookup(self._dns)
            # Only the refresh that started the look-up waits for it; later ones look.
            if self._lookup is None or not (started or self._lookup.done()):
                return
            try:
                wanted = self._lookup.result(timeout=wait if started else 0)
            except concurrent.futures.TimeoutError:
                return  # still looking: a later refresh takes the answer
            except OSError:
                self._lookup = None
                return  # keep what we have; the name may come back
            except BaseException:
                self._lookup = None
                raise
            self._lookup = None
        for address in wanted:
            server = self.servers.get(address)
            if server is None:
                channel = self._channel(address, CHANNEL_OPTIONS)
                self.servers[address] = Server(address, channel, last_progress=now)
            else:
                server.mark_back()
        for address, server in self.servers.items():
            if address not in wanted:
                server.mark_gone()  # no new credits; what it holds still counts

    def _start_lookup(self, target: str) -> concurrent.futures.Future[list[str]]:
        """_resolved(target) on a daemon thread (a look-up that never returns must not keep
        the process from exiting)."""
        fut: concurrent.futures.Future[list[str]] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(self._resolved(target))
            except BaseException as e:  # handed to the loop by result()
                fut.set_exception(e)

        threading.Thread(target=run, name="stoker-resolve", daemon=True).start()
        return fut

    def _resolved(self, target: str) -> list[str]:
        """What the resolver says `target` names, checked: a resolver's mistake is a
        ValueError naming what it returned, not a channel to nowhere."""
        found = self._resolver(target)
        if isinstance(found, str) or not all(isinstance(a, str) for a in found):
            raise ValueError(f"resolver returned {found!r} for {target!r}: expected a list "
                             f"of 'host:port' strings")
        addresses = sorted(set(found))
        try:
            fixed, dns = parse_addresses(addresses) if addresses else ([], None)
        except ValueError as e:
            dns, fixed = str(e), []
        if dns is not None:
            raise ValueError(f"resolver returned {addresses} for {target!r}: expected "
                             f"'host:port' addresses")
        return fixed

    def close(self) -> None:
        for server in self.servers.values():
            for stream in server.let_go():
                stream.close(wait=False)
            server.channel.close()
