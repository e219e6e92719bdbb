"""The scheduler that serves a loader's loop, kept from one epoch into the next:
`KeptScheduler`.

A pass that finishes leaves its scheduler running: it has asked for the next epoch's first
batches (Scheduler.then), and the loop that moves on to that epoch (iterating again, or
set_epoch(e + 1)) takes them from it with no drain at the boundary. A loop that goes
anywhere else (another epoch, a resumed position) closes it: what it fetched ahead is dropped
and counted. The figures of closed schedulers add up here.

Threading: the loop's thread only.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from .policy import group_for
from .scheduler import Scheduler

if TYPE_CHECKING:
    from stoker.v1 import stoker_pb2 as pb

    from ..position.resume import Position
    from ..transport.stream import StreamSpec
    from .servers import ServerSet
    from .window import Window

# Schedulers whose streams may be open. An iterator that is never closed is finalized during
# interpreter shutdown, after daemon threads stop where they stand: one may hold a gRPC call's
# lock, and cancelling that call then blocks for ever (seen as a trainer that never exits).
# So the streams are closed at exit, while the receive threads still run, and their servers'
# channels too: gRPC's own threads then end before shutdown, with no call's lock held (a
# client left with its channels open was once seen stuck in a call's __del__ at exit).
_OPEN: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _close_open_schedulers() -> None:
    for scheduler in list(_OPEN):
        scheduler.close()
        scheduler.close_channels()


FIGURES = ("bytes", "failovers", "hedges", "dropped")


class KeptScheduler:
    """`live`: the scheduler now (None between a pass that was left and the next); the
    streams of each pass ask for `spec(coordinates)`; `closed()` runs when one closes."""

    def __init__(self, servers: ServerSet, spec: Callable[[pb.Coordinates], StreamSpec],
                 closed: Callable[[], None]) -> None:
        self._servers, self._spec, self._closed = servers, spec, closed
        self.live: Scheduler | None = None
        self._totals = dict.fromkeys(FIGURES, 0)

    def start(self, at: Position, coordinates: pb.Coordinates, total: int, window: Window,
              timeout: float) -> Scheduler:
        """The scheduler for the pass from `at` (of `coordinates`, `total` batches): the
        live one if it ran ahead into this epoch's beginning, else a new one."""
        live = self.live
        if live is None or at.next_batch or at.start or not live.follow(at.epoch):
            self.drop()
            live = self.live = Scheduler(
                self._servers, self._spec(coordinates), total=total, start=at.next_batch,
                window=window.size, timeout=timeout, hold_credits=True,
                group=group_for(window.size) if window.widened else 1)
            _OPEN.add(live)
        return live

    def then(self, coordinates: pb.Coordinates, total: int) -> None:
        """The epoch that follows: its first batches are asked for while this one ends."""
        if self.live is not None:
            self.live.then(self._spec(coordinates), total)

    def drop(self) -> None:
        """Close the live scheduler (batches it fetched that the loop did not take are
        dropped: counted when of an epoch the loop did not move on to); add up its figures."""
        live, self.live = self.live, None
        if live is None:
            return
        _OPEN.discard(live)
        live.close()
        self._closed()
        self._totals["bytes"] += live.bytes_received
        for key in FIGURES[1:]:
            self._totals[key] += getattr(live, key)

    def figure(self, key: str) -> int:
        """`key` (one of FIGURES) over every scheduler, the live one included."""
        live = self.live
        if live is None:
            return self._totals[key]
        return self._totals[key] + (live.received() if key == "bytes" else getattr(live, key))
