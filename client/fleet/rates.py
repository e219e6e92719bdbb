"""How fast each server delivers, learned from what it delivers (`Rate`): the scheduler's
measure of a slow server (what a new credit costs there is the policy's: fleet/policy.py).

A server's rate is counted while it holds credits ("busy"): batches and bytes delivered per
busy second, averaged over the last few seconds of busy time (HALF_LIFE); forgotten when it
stalls, goes down or delivers after a long silence (an outage is not a rate: OUTAGE), and
after FORGET s without credits (so a slow server that recovered is tried again). Per batch, because
a server short of CPU or workers delivers few batches; per byte, because a slow link delivers
few bytes whatever the batches: a batch's expected time at a server is the longer of its
seconds per batch and the fleet's mean batch bytes over its bytes/s, so a server measured on
small batches is not taken for fast on large ones. Duplicates count: they were delivered.

Threading: under the scheduler's lock, as the servers' other fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HALF_LIFE = 2.0  # busy seconds after which what a server delivered counts half
# A rate counts once its server has delivered MEASURED batches over MEASURED_SECONDS of holding
# credits: the first few come faster than the rest (the link's buffers, a shaper's burst).
MEASURED, MEASURED_SECONDS = 4, 0.2
# Seconds without credits after which a server's rate is forgotten: a slow server gets few or
# no credits, so without this it would never show that its link or CPU has recovered.
FORGET = 10.0
# A delivery after more than OUTAGE x its seconds per batch so far (and OUTAGE_MIN s) of
# holding credits ends an outage (a freeze, a partition healed, a
# reconnect), which is no measure of its rate either: it is measured afresh from there.
OUTAGE, OUTAGE_MIN = 10.0, 0.5
# A server not measured yet that has delivered nothing counts as slow once it has waited
# this many times the lowest latency of those measured (its first batch is a latency).
FIRST = 2.0


@dataclass
class Rate:
    """Batches and bytes one server delivered over its busy seconds, decayed (HALF_LIFE)."""

    batches: float = 0.0
    nbytes: float = 0.0
    seconds: float = 0.0
    since: float | None = None  # busy since (a credit to an idle server, or a delivery)
    idle_at: float | None = None  # it has held no credits since
    delivered_count: int = 0
    _marks: dict[object, int] = field(default_factory=dict)  # stream -> bytes seen

    def busy(self, now: float) -> None:
        """It had nothing outstanding and is credited now: its busy time starts."""
        if self.stale(now):
            self.forget()
        self.since, self.idle_at = now, None

    def forget(self) -> None:
        """Measure it afresh: it was out of use (stalled, down, idle for FORGET s), and what
        it delivered before says little about what it delivers now."""
        self.batches = self.nbytes = self.seconds = 0.0
        self.since, self.idle_at, self.delivered_count = None, None, 0
        # _marks stay: they are the bytes its open streams had delivered, not a measure; a
        # delivery after this counts only its own bytes.

    def stale(self, now: float) -> bool:
        return self.idle_at is not None and now - self.idle_at >= FORGET

    def delivered(self, now: float, stream: object, received: int, busy: bool) -> None:
        """A batch (or an in-band error) came on `stream`, which has received `received`
        bytes so far; `busy`: the server still holds credits after it."""
        seen = self._marks.pop(stream, 0)
        dt = max(0.0, now - (self.since if self.since is not None else now))
        # An outage: a wait longer than OUTAGE_MIN and than OUTAGE x its seconds per batch
        # so far. Not before one wait is counted (seconds 0: just measured afresh), so a
        # server slower than OUTAGE_MIN a batch is measured too, not reset at each batch.
        if dt > OUTAGE_MIN and self.seconds and dt > OUTAGE * self.seconds / self.batches:
            self.forget()
            seen, dt = received, 0.0  # this batch counts, the outage does not
        self._marks[stream] = received
        while len(self._marks) > 4:  # streams of epochs gone
            del self._marks[next(iter(self._marks))]
        keep = 0.5 ** (dt / HALF_LIFE)
        self.delivered_count += 1
        self.batches = self.batches * keep + 1
        self.nbytes = self.nbytes * keep + max(0, received - seen)
        self.seconds = self.seconds * keep + dt
        self.since = now if busy else None
        self.idle_at = None if busy else now

    def waiting(self, now: float) -> float:
        """Seconds it has held credits since its last delivery (0.0: it holds none)."""
        return now - self.since if self.since is not None else 0.0

    def shown(self, now: float, first: float) -> float:
        """What it has shown so far of its seconds per batch, at least (see costs)."""
        if self.delivered_count:
            return (self.seconds + self.waiting(now)) / (self.batches + 1)
        waited = self.waiting(now)
        return waited if first and waited > first else 0.0

    @property
    def measured(self) -> bool:
        return self.delivered_count >= MEASURED and self.seconds >= MEASURED_SECONDS

    @property
    def batches_per_second(self) -> float | None:
        return self.batches / self.seconds if self.measured else None

    @property
    def bytes_per_second(self) -> float | None:
        return self.nbytes / self.seconds if self.measured and self.nbytes else None

    def seconds_per_batch(self, batch_bytes: float, now: float | None = None) -> float | None:
        """Expected busy seconds per batch of `batch_bytes` (None: not measured yet, or, at
        `now`, no longer: see FORGET)."""
        if not self.measured or (now is not None and self.stale(now)):
            return None
        per = self.seconds / self.batches
        if batch_bytes and self.nbytes:
            per = max(per, batch_bytes * self.seconds / self.nbytes)
        return per
