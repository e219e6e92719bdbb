"""Which server is asked for which batch: the window's credits (`Crediting`, the scheduler's
half that sends them; client/fleet/scheduler.py has the rest: taking, failover, receiving).

Each position in the window [next, next + window) that no live server holds goes to the
usable server expected to deliver it soonest: (its outstanding credits + 1) x its seconds per
batch (client/fleet/rates.py; servers not measured yet count as the fastest, so before any is
measured that is the fewest outstanding credits), ties to the lowest latency; on that
server's stream for the position's epoch (client/fleet/passes.py), opened on first use. A slow
server so gets credits in proportion to its rate.

Threading: under the scheduler's lock, as the rest of its state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .rates import costs
from .servers import Server, ServerState

if TYPE_CHECKING:
    import threading

    from ..transport.stream import BatchStream, StreamFactory
    from .passes import Passes
    from .servers import ServerSet

# A window widened for small batches (widen) credits new indices in groups of window // GROUPS.
GROUPS = 8


def group_for(window: int) -> int:
    """The credits a widened window asks for at once."""
    return max(1, window // GROUPS)


class Crediting:
    """The credits of a Scheduler's window; the fields are the scheduler's."""

    _cond: threading.Condition
    _servers: ServerSet
    _passes: Passes
    _next: int
    _window: int
    _group: int
    _closed: bool
    _ready: dict[int, Any]
    _holders: dict[int, set[Server]]
    _open_stream: StreamFactory
    _clock: Callable[[], float]
    _on_batch: Callable[..., None]
    _on_end: Callable[..., None]
    _cost_memo: tuple[float, dict[Server, float]] | None  # (now, costs then); see _costs

    def _costs(self, now: float) -> dict[Server, float]:
        """costs(), once for every credit sent at `now` (a delivery since forgets it)."""
        if self._cost_memo is None or self._cost_memo[0] != now:
            self._cost_memo = (now, costs(self._servers.servers.values(), now))
        return self._cost_memo[1]

    def _stalled(self) -> set[Server]:
        """Servers stalled now: they take a probe credit (client/fleet/servers.py, PROBE_EVERY),
        never a hedge, which must go to a server known to deliver."""
        return {s for s in self._servers.servers.values() if s.state is ServerState.STALLED}

    def widen(self, window: int) -> None:
        """Keep up to `window` batches in flight from now on (more than before), and ask
        for new ones in groups (see _assign)."""
        with self._cond:
            if window > self._window:
                self.resize(window, group_for(window))

    def resize(self, window: int, group: int) -> None:
        """Keep up to `window` batches in flight from now on (fewer: none is asked for
        until fewer are), new ones `group` at a time."""
        with self._cond:
            self._window, self._group = window, group
            self._assign(self._clock())

    def _assign(self, now: float) -> None:
        """Credit every index in the window that no live server holds. In a widened window,
        new indices go in groups while servers still hold credits: a server handles a
        record of several credits in one go (its workers take them in one message, and
        their batches come back in one write), which is most of a small batch's cost."""
        if self._closed:
            return
        end = min(self._next + self._window, self._passes.end)
        new: list[int] = []
        ready, held, up = self._ready, self._holders, ServerState.UP
        for index in range(self._next, end):  # per batch taken: no call but the lookups
            if index in ready:
                continue
            holders = held.get(index)
            if holders is None:
                new.append(index)
                continue
            for s in holders:
                if s.state is up:
                    break
            else:  # no holder is up: failed over, at once
                self._credit(index, now, exclude=holders)
        if (new and len(new) < self._group and end < self._passes.end and new[0] != self._next
                and any(s.outstanding for s in self._servers.servers.values() if s.up)):
            return  # batches come back soon, and this is called again
        records: dict[BatchStream, list[int]] = {}
        for index in new:
            self._credit(index, now, exclude=set(), records=records)
        for stream, indices in records.items():
            stream.credit(indices)

    def _credit(self, index: int, now: float, exclude: set[Server],
                records: dict[BatchStream, list[int]] | None = None) -> bool:
        """Ask the best usable server for the batch at position `index`: at once, or, given
        `records`, by adding it to that server's stream's record (the caller sends them)."""
        candidates = [s for s in self._servers.servers.values()
                      if s not in exclude and s.usable(now)]
        if not candidates:
            return False
        cost = self._costs(now)
        server = min(candidates,
                     key=lambda s: ((len(s.outstanding) + 1) * cost[s], s.latency or 0.0))
        lane = self._passes.of(index)
        stream = server.streams.get(lane.epoch)
        if stream is None:
            stream = self._open_stream(server.channel, server.address, lane.spec,
                                       self._on_batch, self._on_end)
            server.mark_up(lane.epoch, stream)
        if not server.outstanding:
            server.last_progress = now  # patience runs from when it has work
            server.rate.busy(now)
        server.outstanding[index] = now
        self._holders.setdefault(index, set()).add(server)
        if records is None:
            stream.credit([index - lane.base])
        else:
            records.setdefault(stream, []).append(index - lane.base)
        return True
