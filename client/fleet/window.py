"""The `Window` of batches a loader keeps in flight: `prefetch` against the servers'
`max_credits` (`credit_window`), widened for small batches, and following what the fleet can
do when it adapts.

A server's max_credits below prefetch is said on the `stoker.client` logger (shown without any
logging configuration: _log.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from .._log import say


@dataclass(frozen=True)
class Fleet:
    """What the servers in use can do together: worker processes, the samples/s they build
    (0.0: not measured yet), and the mean seconds from a credit to its batch (None: no
    batch yet)."""

    workers: int
    samples_per_second: float
    latency: float | None


# What a server allows when it does not say (server.max_credits' default): the most batches
# prefetch_bytes keeps in flight then.
MAX_CREDITS = 64


def credit_window(prefetch: int, max_credits: int, address: str) -> int:
    """`prefetch`, or the server's `max_credits` where that is lower (0: the server did not
    say), with a warning: one server may hold every credit (when the others fail), and more
    than max_credits ends its stream with RESOURCE_EXHAUSTED."""
    if not max_credits or prefetch <= max_credits:
        return prefetch
    say(logging.WARNING, "prefetch=%d is more than the server's max_credits=%d (%s): one "
        "stream may hold at most that many batch requests, and when the other servers fail "
        "one server holds them all; prefetching %d batches instead (lower prefetch, or raise "
        "server.max_credits)", prefetch, max_credits, address, max_credits)
    return max_credits


# The adapting window (prefetch not given) is looked at once per ADAPT_EVERY seconds of the
# loop: a loop that waited more than STALL_GROW of that time grows it, one that waited less
# than STALL_SHRINK lets it shrink back towards what the fleet needs. The fleet needs
# (its batches/s) x (a batch's latency) in flight, times MARGIN, plus SPARE.
ADAPT_EVERY = 1.0
STALL_GROW, STALL_SHRINK = 0.02, 0.005
MARGIN, SPARE = 1.25, 2
# A loop that stalls while the servers deliver at least this share of what they said they
# can build waits on the fleet's rate, not on the window: a wider one would only queue more
# batches at the servers (each a segment, and memory here) and lengthen the latency it is
# measured by (credit to arrival includes the queue), so it is not grown then.
SATURATED = 0.9


class Window:
    """The batches a loader keeps in flight (`size`, and `why`): `prefetch`, under every
    server's max_credits once they said it, widened once for small batches (`fit`); and, when
    `adapts` (prefetch not given), following what the servers can do and the loop's stall
    (`adapt`) within `memory_budget` bytes of buffers.

    Threading: the loop's thread, but for `batch_bytes`, which receive threads set as they
    allocate a batch (the latest wins: batches of one loader keep their size, near enough).
    """

    def __init__(self, prefetch: int, adapts: bool = False, memory_budget: int = 0) -> None:
        self.size = prefetch
        self.max_credits = MAX_CREDITS  # the lowest the servers said
        self.sized = False  # fitted to the batches' size (see fit)
        self.widened = False  # ... and widened for small batches
        self.batch_bytes = 0  # of the latest batch received
        self.adapts, self.memory_budget = adapts, memory_budget
        self.floor = prefetch  # an adapting window never shrinks below it (nor below fit's)
        self.why = f"prefetch={prefetch}" if not adapts else f"default {prefetch} batches"
        self._seen: tuple[float, float, int] | None = None  # (wait, loop s, batches) then

    @property
    def budget_batches(self) -> int:
        """The batches memory_budget holds beside the one the loop holds and the one it let
        go (0: not known before the first batch, or not adapting)."""
        if not (self.adapts and self.batch_bytes):
            return 0
        return max(1, self.memory_budget // self.batch_bytes - 2)

    def note(self) -> tuple[int, str, int]:
        """(size, why, budget_batches): for stats() and the servers' /v1/stats."""
        return self.size, self.why, self.budget_batches

    def stats(self) -> dict[str, int | str]:
        """stats()'s `window`, `why` and `budget_batches`."""
        return dict(zip(("window", "why", "budget_batches"), self.note(), strict=True))

    def start(self, fleet: Fleet) -> None:
        """Before the first batch: enough for every worker the servers said they have."""
        if self.adapts and fleet.workers:
            want = min(max(self.floor, math.ceil(fleet.workers * MARGIN) + SPARE),
                       self.max_credits // 2)
            if want > self.size:
                self.size = want
                self.why = f"{fleet.workers} workers, their rate not measured yet"

    def due(self, loop: float) -> bool:
        """Whether adapt() would look at the fleet after a batch at `loop` seconds of the
        loop (at most every ADAPT_EVERY s): the fleet's figures are worth taking then only."""
        return bool(self.adapts and self.batch_bytes) and (
            self._seen is None or loop - self._seen[1] >= ADAPT_EVERY)

    def adapt(self, fleet: Fleet, rows: float, wait: float, loop: float, taken: int
              ) -> int | None:
        """After a batch: the new size if it changes (None: it stays), from the fleet
        (`rows`: samples a batch) and the loop's `wait` and `loop` seconds and the batches it
        has `taken`, so far."""
        if not (self.adapts and self.batch_bytes):
            return None
        if self._seen is None or loop - self._seen[1] < ADAPT_EVERY:
            self._seen = self._seen or (wait, loop, taken)
            return None
        stall = (wait - self._seen[0]) / (loop - self._seen[1])
        delivered = (taken - self._seen[2]) * rows / (loop - self._seen[1])  # samples/s
        self._seen = (wait, loop, taken)
        rate = fleet.samples_per_second / rows if rows else 0.0  # batches/s
        if rate and fleet.latency:
            need = math.ceil(rate * fleet.latency * MARGIN) + SPARE
            why = (f"fleet rate {fleet.samples_per_second:,.0f} samples/s x latency "
                   f"{fleet.latency:.2g} s")
        else:
            need, why = self.floor, self.why
        size = self.size
        if stall > STALL_GROW and delivered >= SATURATED * fleet.samples_per_second > 0:
            why = (f"loop stalled {stall:.0%} with the servers at their rate ({delivered:,.0f} "
                   f"of {fleet.samples_per_second:,.0f} samples/s): more servers would help, "
                   "a wider window would not")
        elif stall > STALL_GROW:
            size = max(size + 1, math.ceil(size * MARGIN), need)
            why = f"loop stalled {stall:.0%}: grown ({why})"
        elif size < need or stall < STALL_SHRINK:
            size = need if size < need else max(need, size - max(1, size // 8))
        size = max(size, self.floor)
        cap, capped = min((self.budget_batches, "memory_budget"),
                          (max(self.max_credits // 2, self.floor), "max_credits / 2"))
        if size >= cap:
            size, why = cap, f"{why}; capped by {capped}"
        changed = size != self.size
        self.size, self.why = size, why
        return size if changed else None

    def cap_credits(self, max_credits: int, address: str) -> None:
        """A server said its max_credits: the window stays under it, and so does any
        widening of it later (0: a server that did not say)."""
        self.size = credit_window(self.size, max_credits, address)
        self.floor = min(self.floor, self.size)
        if max_credits:
            self.max_credits = min(self.max_credits, max_credits)

    def fit(self, prefetch_bytes: int) -> int | None:
        """Once the first batch's size is known: small batches are kept in flight by
        prefetch_bytes, not prefetch (each costs the servers a fixed time, which more in
        flight, asked for in groups, hides). The new, wider size, for the caller to grow its
        buffers and streams to, or None. Once per loader (`sized`)."""
        if not self.batch_bytes:
            return None
        self.sized = True
        if not prefetch_bytes:
            return None
        # As many as prefetch_bytes holds, at most half the servers' max_credits: failover
        # and hedges credit on top of it.
        window = min(prefetch_bytes // max(self.batch_bytes, 1), self.max_credits // 2)
        if self.adapts:
            window = min(window, self.budget_batches)
        if window <= self.size:
            return None
        self.size, self.widened = window, True
        self.floor = max(self.floor, window)
        self.why = f"prefetch_bytes={prefetch_bytes} of {self.batch_bytes}-byte batches"
        return window
