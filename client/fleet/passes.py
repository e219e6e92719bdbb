"""The epochs one Scheduler serves, laid end to end: `Passes`.

A loop that finishes an epoch usually goes on to the next one, whose order is a pure function
of its coordinates: so its first batches are asked for while the loop ends the current one,
and an epoch boundary costs the loop no wait (docs/tuning.md#epoch-boundaries). The scheduler
therefore numbers batches by *position*: pass k's batch i is position `base_k + i`, and the
passes follow one another without a gap, so its window, holders and hedges work on positions
as they did on one epoch's indices (the first pass has base 0: positions are its indices).

Each pass has its own stream on each server (a stream's credits are taken under its
coordinates, and credits on the data connection race a new coordinates message on gRPC; a
second stream has no such race). A pass the loop has finished is retired: its streams are
closed, what it still had asked for (hedges) forgotten.

Threading: under the scheduler's lock, as the scheduler's own state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..transport.stream import Stream, StreamSpec
from .servers import Server


@dataclass(frozen=True, eq=False)
class Pass:
    """One epoch's batches [start, total) as positions [base + start, base + total)."""

    spec: StreamSpec  # what its streams ask for: the epoch's coordinates
    base: int
    start: int
    total: int

    @property
    def epoch(self) -> int:
        return self.spec.coordinates.epoch

    @property
    def end(self) -> int:
        return self.base + self.total

    def holds(self, position: int) -> bool:
        return self.base + self.start <= position < self.end


class Passes:
    """The passes a scheduler serves, the loop's (`loop`) first; later ones are ahead of it."""

    def __init__(self, first: Pass) -> None:
        self._passes = [first]
        self.loop = first
        self._finished: set[int] = set()  # epochs whose streams are closed

    @property
    def end(self) -> int:
        """The position after the last batch of the last pass."""
        return self._passes[-1].end

    def add(self, spec: StreamSpec, total: int) -> Pass:
        """The epoch after the last one, from its batch 0."""
        following = Pass(spec, self.end, 0, total)
        self._passes.append(following)
        return following

    def ahead(self) -> list[Pass]:
        """The passes after the loop's."""
        return self._passes[self._passes.index(self.loop) + 1:]

    def of(self, position: int) -> Pass:
        for p in self._passes:
            if p.holds(position):
                return p
        raise KeyError(position)

    def follow(self, epoch: int) -> bool:
        """The loop moves on to the pass after its own, which must be `epoch`'s (False: it
        is not, or there is none: the caller starts afresh)."""
        ahead = self.ahead()
        if not ahead or ahead[0].epoch != epoch:
            return False
        self.loop = ahead[0]
        self._passes = self._passes[self._passes.index(self.loop):]
        return True

    def served_by(self, server: Server, stream: Stream) -> Pass | None:
        """The pass `stream` (one of `server`'s) serves; None for a stream let go of."""
        for p in self._passes:
            if server.streams.get(p.epoch) is stream:
                return p
        return None

    def drop_ahead(self) -> list[Pass]:
        """Forget the passes after the loop's (the caller retires them)."""
        ahead = self.ahead()
        self._passes = self._passes[:len(self._passes) - len(ahead)]
        return ahead

    def drop_beyond_loop(self, ready: dict[int, Any]) -> int:
        """Take out of `ready` the batches of passes after the loop's: how many."""
        beyond = [p for p in ready if p >= self.loop.end]
        for position in beyond:
            del ready[position]
        return len(beyond)

    @staticmethod
    def retire(done: Pass, servers: Iterable[Server], holders: dict[int, set[Server]]
               ) -> list[Stream]:
        """The loop has taken every batch of `done`: forget what its streams still held
        (hedges' duplicates); its streams, which the caller closes."""
        streams = []
        for server in servers:
            stream = server.streams.pop(done.epoch, None)
            if stream is not None:
                streams.append(stream)
            for position in [p for p in server.outstanding if done.holds(p)]:
                del server.outstanding[position]
        for position in [p for p in holders if done.holds(p)]:
            del holders[position]
        return streams

    def finished(self, next_position: int) -> Iterator[Pass]:
        """The passes the loop has just finished (every position before `next_position`),
        each once: the caller closes their streams."""
        for p in self._passes:
            if p.end <= next_position and p.epoch not in self._finished:
                self._finished.add(p.epoch)
                yield p
