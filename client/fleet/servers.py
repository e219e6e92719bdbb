"""The data servers a loader may use: their addresses, channels and health as seen from here.

Addresses are "host:port" strings, or one "dns:///name:port" target re-resolved every
`dns_refresh` seconds (fleet/discovery.py), so servers added later are used and removed ones
drained.
"""

from __future__ import annotations

import concurrent.futures
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from .._backoff import FIRST, MOST, Backoff
from .._errors import RemoteError
from ..transport.stream import Stream
from .discovery import RESOLVE_EVERY, RESOLVE_WAIT, Resolver, parse_addresses, resolve, start_lookup
from .rates import Rate
from .window import Fleet

BACKOFF_FIRST, BACKOFF_MAX = FIRST, MOST  # seconds before a failed server is tried again
DRAIN_RETRY = 1.0  # seconds before a server that drained is tried again
# Seconds after a stall (and after the last credit) before a stalled server is given a probe
# credit: its host may have lost its network and found it again (a partition that healed),
# and only a batch delivered says so. One probe at a time beyond what it held when it
# stalled (so a server that wakes up never finds more credits than a window's: max_credits);
# its index is asked of an up server too, at once.
PROBE_EVERY = 2.0

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
    streams: dict[int, Stream] = field(default_factory=dict)
    outstanding: dict[int, float] = field(default_factory=dict)  # batch index -> credited at
    state: ServerState = ServerState.UP
    retry_at: float = 0.0
    backoff: Backoff = field(default_factory=Backoff)
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
    def mark_up(self, epoch: int, stream: Stream) -> None:
        """A new stream, for `epoch`, is open to it (it was usable: up, or down and due for
        a retry, or stalled and due for a probe). A stalled server stays stalled: a stream
        opened for its probe (the epoch it stalled in was let go) is no sign of life; it is
        up again when it delivers (mark_delivered)."""
        if self.state is not ServerState.STALLED:
            self.state = ServerState.UP
        self.streams[epoch] = stream

    def let_go(self) -> list[Stream]:
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

    def took(self, index: int, item: Any, stream: Stream, now: float) -> list[Stream]:
        """It delivered `item` (a batch, or an in-band error) for `index` on `stream`: counted
        in its rate; an UNAVAILABLE one says it drains (no new credits). The streams to let
        go: a draining server done with what it took (its shutdown need not wait for us)."""
        self.mark_delivered(index, now)
        self.rate.delivered(now, stream, stream.bytes_received, bool(self.outstanding))
        if isinstance(item, RemoteError) and item.code == grpc.StatusCode.UNAVAILABLE:
            self.mark_draining(item.details)
        if self.state is ServerState.DRAINING and not self.outstanding:
            self.mark_drained(now)
            return self.let_go()
        return []

    def mark_delivered(self, index: int, now: float) -> None:
        """Its stream answered `index` (a batch or an in-band error): it is alive."""
        asked = self.outstanding.pop(index, None)
        if asked is not None:
            self.record_latency(now - asked)
        self.last_progress = now
        self.backoff.reset()
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
        self.retry_at = now + self.backoff.next()

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

    def streams(self) -> list[Stream]:
        """Every server's open streams."""
        return [st for s in self.servers.values() for st in s.streams.values()]

    def fleet(self) -> Fleet:
        """What the servers in use said they can do, and their batches' latency."""
        up = [s for s in self.servers.values() if s.up]
        said = [next((st.capacity for st in s.streams.values() if st.capacity),
                     s.capacity) or (0, 0.0) for s in up]
        latencies = [s.latency for s in up if s.latency is not None]
        return Fleet(sum(w for w, _ in said), sum(r for _, r in said),
                     sum(latencies) / len(latencies) if latencies else None)

    def summary(self) -> str:
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
                self._lookup = start_lookup(self._resolver, self._dns)
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
            known = self.servers.get(address)
            if known is None:
                channel = self._channel(address, CHANNEL_OPTIONS)
                self.servers[address] = Server(address, channel, last_progress=now)
            else:
                known.mark_back()
        for address, server in self.servers.items():
            if address not in wanted:
                server.mark_gone()  # no new credits; what it holds still counts

    def close(self) -> None:
        for server in self.servers.values():
            for stream in server.let_go():
                stream.close(wait=False)
            server.channel.close()
