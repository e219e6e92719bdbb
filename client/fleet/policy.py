"""The crediting and hedging policy: pure functions of what the scheduler knows now, each
returning a decision that the scheduler applies under its lock (fleet/credits.py does).

Crediting. Each position in the window [next, next + window) that no live server holds
(`due`) goes to the usable server expected to deliver it soonest (`pick`): (its outstanding
credits + 1) x its seconds per batch (`costs`, from fleet/rates.py; servers not measured yet
count as the fastest, so before any is measured that is the fewest outstanding credits), ties
to the lowest latency. A slow server so gets credits in proportion to its rate. A widened
window holds new credits back until a group is due (`hold_back`). A server takes no credit
before it has answered the loader's first Describe (its `contact`); for AWAIT_CONTACT s from
the pass's first credits, the servers that answered hold only their share of the window, by
count, and the rest waits for those on their way (`answered_share`).

Hedging. A server is slow once its expected seconds per batch are more than SLOW times the
fastest server's (`late`). Each batch it holds that no other server holds is expected at (its
rank in that server's queue + 1) x its seconds per batch from now, and is needed by the loop
once the batches before it are taken, at (its distance from the loop's next batch) / (the
fleet's batches/s). One expected later than needed is also asked of the server that would
deliver it soonest, if that is sooner (`sooner`): the first copy to arrive is used, the other
dropped (fleet/scheduler.py), once per batch. So the loop waits on the slow server only for
what it delivers in time. Nothing to do, and no loop over batches, while no server is slow.
The batch the loop waits on is hedged once it has been outstanding longer than
max(HEDGE_MIN, 4 x the lowest latency) (`hedge_awaited`); a server that holds credits and
delivers nothing for its patience is stalled (`stalled`).

Threading: none of its own: called under the scheduler's lock, on the values it passes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import grpc

from .._errors import RemoteError
from .rates import FIRST
from .servers import ServerState

if TYPE_CHECKING:
    from .servers import Server

# Codes every server would answer the same way: retrying elsewhere cannot help.
FATAL = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE}
# A window widened for small batches (widen) credits new indices in groups of window // GROUPS.
GROUPS = 8
SLOW = 2.0  # times the fastest server's seconds per batch
HEDGE_MIN, STALL_MIN = 0.5, 2.0  # seconds
# Seconds from a pass's first credits during which servers still answering the loader's first
# Describe have their share of the window kept for them (answered_share). The loader
# describes the dataset at the first server that answers and starts at once: with the whole
# window on that server, 2 servers x 8 workers had the second idle for the first half second
# and the loop's batches 4-11 hedged to it, built twice (issue 49). Bounded: an address that
# black-holes holds up the window's tail this long at most (and the first batch never). The
# loop's first batch waits up to agreement.CHECK_WAIT (as long) for those answers anyway.
AWAIT_CONTACT = 0.5


def group_for(window: int) -> int:
    """The credits a widened window asks for at once."""
    return max(1, window // GROUPS)


def costs(servers: Iterable[Server], now: float) -> dict[Server, float]:
    """Each server's expected seconds per batch of the fleet's mean size. A server not
    measured yet is taken to be as fast as the fastest measured one (so it is tried, and
    measured), unless what it has shown already says it is slower: the seconds it has held
    credits over the batches it delivered and the one it is on; or, before its first batch
    (a latency more than a rate), the seconds it has waited for it, once longer than FIRST x
    the lowest latency of those measured. None measured: 1.0 each, which makes the earliest
    expected delivery the fewest outstanding credits."""
    servers = list(servers)
    batches = sum(s.rate.batches for s in servers)
    mean = sum(s.rate.nbytes for s in servers) / batches if batches else 0.0
    known = {s: s.rate.seconds_per_batch(mean, now) for s in servers}
    fastest = min((c for c in known.values() if c is not None), default=1.0)
    latency = min((s.latency for s, c in known.items() if c is not None and s.latency),
                  default=0.0)
    cost = {}
    for s, c in known.items():
        if c is None:
            c = fastest
            if s.outstanding and not s.rate.stale(now):
                c = max(c, s.rate.shown(now, first=FIRST * latency))
        cost[s] = c
    return cost


def pick(servers: Iterable[Server], cost: Mapping[Server, float], now: float,
         exclude: Collection[Server] = ()) -> Server | None:
    """The usable server (not in `exclude`) expected to deliver a new credit soonest; None
    when none is usable."""
    candidates = [s for s in servers if s not in exclude and s.usable(now)]
    if not candidates:
        return None
    return min(candidates, key=lambda s: ((len(s.outstanding) + 1) * cost[s], s.latency or 0.0))


def answered_share(servers: Iterable[Server], window: int, waited: float) -> int | None:
    """The most credits the servers may hold between them while others have yet to answer
    the loader's first Describe, `waited` s into the pass (None: no limit): the window's
    share of those that answered, by count, until AWAIT_CONTACT."""
    if waited >= AWAIT_CONTACT:
        return None
    answering = answered = 0
    for s in servers:
        if s.contact is not None and not s.contact.done():
            answering += s.up
        else:
            answered += s.up
    if not (answering and answered):
        return None
    return -(-window * answered // (answered + answering))


def due(start: int, end: int, ready: Collection[int], holders: Mapping[int, set[Server]]
        ) -> tuple[list[int], list[int]]:
    """The positions in [start, end) to credit: (new ones, which no server was asked for;
    failed over ones, whose every holder is no longer up)."""
    new: list[int] = []
    failed: list[int] = []
    up = ServerState.UP
    for index in range(start, end):  # per batch taken: no call but the lookups
        if index in ready:
            continue
        held = holders.get(index)
        if held is None:
            new.append(index)
            continue
        for s in held:  # a loop, not any(generator): this runs for the whole window
            if s.state is up:
                break
        else:
            failed.append(index)
    return new, failed


def hold_back(new: list[int], group: int, start: int, end: int, last: int,
              servers: Iterable[Server]) -> bool:
    """Whether to keep `new` credits back for now: fewer than a `group` of them, not the one
    the loop needs next (`start`), the window short of the passes' `last` position, and
    servers still holding credits (their batches come back soon, and this is asked again).
    A server handles a record of several credits in one go, most of a small batch's cost."""
    return bool(new) and len(new) < group and end < last and new[0] != start and any(
        s.outstanding for s in servers if s.up)


def stalled(servers: Iterable[Server]) -> set[Server]:
    """Servers stalled now: they take a probe credit (fleet/servers.py, PROBE_EVERY), never a
    hedge, which must go to a server known to deliver."""
    return {s for s in servers if s.state is ServerState.STALLED}


def stalling(servers: Iterable[Server], now: float) -> list[Server]:
    """Up servers holding credits that delivered nothing for their patience: max(STALL_MIN,
    10 x their latency)."""
    return [s for s in servers if s.outstanding and s.up
            and now - s.last_progress > max(STALL_MIN, 10 * (s.latency or 0.0))]


def late(servers: Iterable[Server], cost: Mapping[Server, float], next_index: int,
         holders: Mapping[int, set[Server]], hedged: Collection[int]
         ) -> list[tuple[Server, int, float]]:
    """(slow server, position, seconds until it is expected there) for each batch a slow
    server will deliver after the loop needs it, held by no other server and not hedged."""
    up = [s for s in servers if s.up]
    if len(up) < 2:
        return []
    fastest = min(cost[s] for s in up)
    slow = [s for s in up if s.outstanding and cost[s] > SLOW * fastest]
    if not slow:
        return []
    fleet = sum(1.0 / cost[s] for s in up)  # batches/s
    found = []
    for server in slow:
        for rank, index in enumerate(sorted(server.outstanding)):
            held = holders.get(index)
            if held is None or index in hedged or len(held) > 1:
                continue  # delivered (a duplicate on its way), or asked of another too
            expected = (rank + 1) * cost[server]
            if expected > (index - next_index) / fleet:
                found.append((server, index, expected))
    return found


def sooner(servers: Iterable[Server], cost: Mapping[Server, float], now: float,
           exclude: Collection[Server], expected: float) -> Server | None:
    """The server `pick` would ask, if it is expected to deliver sooner than `expected` s."""
    best = pick(servers, cost, now, exclude)
    if best is None or (len(best.outstanding) + 1) * cost[best] >= expected:
        return None
    return best


def hedge_awaited(index: int, held: Collection[Server], hedged: Collection[int],
                  servers: Iterable[Server], now: float) -> bool:
    """Whether to ask another server for the batch the loop waits on: asked of `held` longer
    ago than max(HEDGE_MIN, 4 x the lowest latency), and not hedged before."""
    if index in hedged or not held:
        return False
    asked = min(s.outstanding.get(index, now) for s in held)
    fastest = min((s.latency for s in servers if s.latency is not None), default=0.0)
    return now - asked > max(HEDGE_MIN, 4 * fastest)


def retried(item: Any, retries: int, limit: int) -> bool:
    """Whether a batch's in-band error is asked again (UNAVAILABLE: a draining server; up to
    `limit` times INTERNAL: a worker that died or hung) rather than handed to the loop."""
    return isinstance(item, RemoteError) and (
        item.code == grpc.StatusCode.UNAVAILABLE
        or (item.code == grpc.StatusCode.INTERNAL and retries < limit))
