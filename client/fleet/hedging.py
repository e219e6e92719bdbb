"""Batches held by a slow server, asked of a faster one before the loop needs them (`Hedging`,
a part of the scheduler; client/fleet/scheduler.py has the rest).

A server is slow once its expected seconds per batch (client/fleet/rates.py) are more than SLOW
times the fastest server's. Each batch it holds that no other server holds is expected at
(its rank in that server's queue + 1) x its seconds per batch from now, and is needed by the
loop once the batches before it are taken, at (its distance from the loop's next batch) / (the
fleet's batches/s). One expected later than needed is also asked of the server that would
deliver it soonest, if that is sooner: the first copy to arrive is used, the other dropped
(client/fleet/scheduler.py, _on_batch), once per batch. So the loop waits on the slow server only
for what it delivers in time, and the slow server keeps delivering that.

Looked at after every batch the loop takes and while it waits: nothing to do, and no loop
over batches, while no server is slow.

Threading: under the scheduler's lock, as the rest of its state.
"""

from __future__ import annotations

from .crediting import Crediting

SLOW = 2.0  # times the fastest server's seconds per batch


class Hedging(Crediting):
    """The scheduler's hedges of late batches; the fields are the scheduler's."""

    _hedged: set[int]
    hedges: int

    def _hedge_late(self, now: float) -> None:
        """Ask a faster server for each batch a slow one will deliver after the loop needs
        it (see the module docstring)."""
        up = [s for s in self._servers.servers.values() if s.up]
        if len(up) < 2:
            return
        cost = self._costs(now)
        fastest = min(cost[s] for s in up)
        slow = [s for s in up if s.outstanding and cost[s] > SLOW * fastest]
        if not slow:
            return
        fleet = sum(1.0 / cost[s] for s in up)  # batches/s
        for server in slow:
            for rank, index in enumerate(sorted(server.outstanding)):
                holders = self._holders.get(index)
                if holders is None or index in self._hedged or len(holders) > 1:
                    continue  # delivered (a duplicate on its way), or asked of another too
                expected = (rank + 1) * cost[server]
                if expected <= (index - self._next) / fleet:
                    continue  # in time
                stalled = self._stalled()
                others = [s for s in self._servers.servers.values()
                          if s is not server and s not in stalled and s.usable(now)]
                if not others or min((len(s.outstanding) + 1) * cost[s]
                                     for s in others) >= expected:
                    continue  # no one would deliver it sooner
                if self._credit(index, now, exclude={server, *stalled}):
                    self._hedged.add(index)
                    self.hedges += 1
                    server.hedged += 1
