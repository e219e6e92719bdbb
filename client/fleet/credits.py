"""Which server holds which batch, and the credits that change it: `Credits`, the ledger the
scheduler keeps and the one place credits are sent (fleet/policy.py decides; this applies).

A credit goes on the chosen server's stream for the position's epoch (fleet/passes.py),
opened on first use; new credits of one assignment go out as one record per stream.

Threading: under the scheduler's lock, as the rest of its state (the scheduler owns one).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import grpc

from . import policy

if TYPE_CHECKING:
    from ..transport.stream import Stream, StreamFactory
    from .passes import Passes
    from .servers import Server, ServerSet


# A take looks for late batches at most this often (a hedge waits HEDGE_MIN at least): the
# costs of every server, per batch, were a sixth of the loop's CPU a take.
LATE_EVERY = policy.HEDGE_MIN / 10

class Credits:
    """The servers asked for each position (`holders`), the positions hedged (`hedged`, and
    how many: `hedges`), and the costs computed for the credits sent at one time."""

    def __init__(self, servers: ServerSet, passes: Passes, open_stream: StreamFactory,
                 on_batch: Callable[..., None], on_end: Callable[..., None]) -> None:
        self._servers, self._passes = servers, passes
        self._open_stream, self._on_batch, self._on_end = open_stream, on_batch, on_end
        self.holders: dict[int, set[Server]] = {}  # position -> servers asked for it
        self.hedged: set[int] = set()
        self.hedges = 0
        self._retries: dict[int, int] = {}  # position -> INTERNAL errors it had
        self._memo: tuple[float, dict[Server, float]] | None = None  # (now, costs then)
        self._late_looked = float("-inf")  # when hedge_late last looked
        self._began: float | None = None  # when the first credits were due

    def costs(self, now: float) -> dict[Server, float]:
        """policy.costs(), once for every credit sent at `now` (see `forget`)."""
        if self._memo is None or self._memo[0] != now:
            self._memo = (now, policy.costs(self._servers.servers.values(), now))
        return self._memo[1]

    def forget(self) -> None:
        """A delivery or a stream's end changed what the servers cost."""
        self._memo = None

    def assign(self, now: float, start: int, window: int, group: int,
               ready: Collection[int]) -> None:
        """Credit every position in the window [start, start + window) that no live server
        holds: failed over ones at once, new ones in records (held back while a widened
        window's group is not due: policy.hold_back)."""
        end = min(start + window, self._passes.end)
        new, failed = policy.due(start, end, ready, self.holders)
        for index in failed:  # no holder is up: failed over, at once
            self.credit(index, now, exclude=self.holders[index])
        servers = self._servers.servers.values()
        if policy.hold_back(new, group, start, end, self._passes.end, servers):
            return
        self._began = now if self._began is None else self._began
        share = policy.answered_share(servers, window, now - self._began)
        if share is not None:  # the rest kept for servers still answering; the loop's next
            held = sum(len(s.outstanding) for s in servers)  # batch is never kept back
            new = new[:max(share - held, int(bool(new) and new[0] == start))]
        records: dict[Stream, list[int]] = {}
        for index in new:
            self.credit(index, now, exclude=(), records=records)
        for stream, indices in records.items():
            stream.credit(indices)

    def credit(self, index: int, now: float, exclude: Collection[Server],
               records: dict[Stream, list[int]] | None = None) -> bool:
        """Ask policy.pick's server for the batch at position `index`: at once, or, given
        `records`, by adding it to that server's stream's record (the caller sends them)."""
        server = policy.pick(self._servers.servers.values(), self.costs(now), now, exclude)
        return server is not None and self.send(server, index, now, records)

    def send(self, server: Server, index: int, now: float,
             records: dict[Stream, list[int]] | None = None) -> bool:
        """Credit `server` with position `index`, on its stream for the position's epoch."""
        part = self._passes.of(index)
        stream = server.streams.get(part.epoch)
        if stream is None:
            stream = self._open_stream(server.channel, server.address, part.spec,
                                       self._on_batch, self._on_end)
            server.mark_up(part.epoch, stream)
        if not server.outstanding:
            server.last_progress = now  # patience runs from when it has work
            server.rate.busy(now)
        server.outstanding[index] = now
        self.holders.setdefault(index, set()).add(server)
        if records is None:
            stream.credit([index - part.base])
        else:
            records.setdefault(stream, []).append(index - part.base)
        return True

    def hedge_late(self, now: float, next_index: int, every: float = 0.0) -> None:
        """Ask a faster server for each batch a slow one will deliver after the loop needs
        it (policy.late, policy.sooner); not if it looked less than `every` s ago."""
        if now - self._late_looked < every:
            return
        self._late_looked = now
        servers = self._servers.servers.values()
        cost = self.costs(now)
        for server, index, expected in policy.late(servers, cost, next_index, self.holders,
                                                   self.hedged):
            skip = {server, *policy.stalled(servers)}
            other = policy.sooner(servers, cost, now, skip, expected)
            if other is not None and self.send(other, index, now):
                self._hedged(index)
                server.hedged += 1

    def hedge_awaited(self, index: int, now: float) -> None:
        """Ask another server for the batch the loop waits on, once it is late there."""
        servers = self._servers.servers.values()
        held = self.holders.get(index, set())
        if policy.hedge_awaited(index, held, self.hedged, servers, now) and self.credit(
                index, now, exclude=held | policy.stalled(servers)):
            self._hedged(index)

    def _hedged(self, index: int) -> None:
        self.hedged.add(index)
        self.hedges += 1

    def retry(self, index: int, server: Server, item: Any, now: float, limit: int) -> bool:
        """`server` answered position `index` with an error asked again elsewhere
        (policy.retried): True, and it no longer holds it. Whatever broke there on an
        INTERNAL (a worker that died or hung) may break again: another server first."""
        if not policy.retried(item, self._retries.get(index, 0), limit):
            return False
        holders = self.holders.get(index, set())
        holders.discard(server)
        if item.code == grpc.StatusCode.INTERNAL:
            self._retries[index] = self._retries.get(index, 0) + 1
            if not any(s.up for s in holders):
                self.credit(index, now, exclude={server})
        return True

    def lost(self, server: Server, error: Any, now: float) -> list[Stream]:
        """`server`'s stream failed with `error`: it holds nothing now and is down (retried
        after its backoff); the streams to let go."""
        for index in server.outstanding:
            self.holders.get(index, set()).discard(server)
        server.outstanding.clear()
        server.mark_down(error, now)
        self.forget()
        return server.let_go()
