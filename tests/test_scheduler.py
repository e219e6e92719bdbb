"""The scheduler's timing, in-process: hedges, stalls, failover and backoff, timeouts.

No server and no real time: streams are fakes the test drives (deliver batch k, refuse it
in-band, fail with a gRPC code, or say nothing), and the clock is a number the test moves.
Each test checks its constant on both sides: just before it nothing happens, just after it
does. The loop's waits go through `Scheduler.poll`, the one look take() makes every TICK.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from stoker.client import RemoteError
from stoker.client.fleet.policy import HEDGE_MIN, STALL_MIN
from stoker.client.fleet.scheduler import BATCH_RETRIES, Scheduler
from stoker.client.fleet.servers import BACKOFF_FIRST, DRAIN_RETRY, PROBE_EVERY, Server, ServerSet
from stoker.client.transport.stream import StreamSpec
from stoker.v1 import stoker_pb2 as pb

A, B, C = "a:1", "b:1", "c:1"
EPS = 1e-3
T0 = 1000.0
TIMEOUT = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now

    def at(self, seconds: float) -> None:
        """Move to `seconds` after T0."""
        self.now = T0 + seconds


class FakeStream:
    """A stream whose server the test plays: what it was asked, and what it answers."""

    def __init__(self, channel: Any, address: str, spec: StreamSpec, on_batch: Any,
                 on_end: Any) -> None:
        self.address = address
        self.bytes_received = 0
        self.capacity: tuple[int, float] | None = None
        self.credits: list[int] = []
        self.records: list[list[int]] = []  # each credit() call: one record on the wire
        self.closed = False
        self._on_batch, self._on_end = on_batch, on_end

    def credit(self, indices: Any) -> None:
        self.credits.extend(indices)
        self.records.append(list(indices))

    def report(self, wait_seconds: float, loop_seconds: float,
               window: tuple[int, str, int] = (0, "", 0)) -> None:
        pass

    def close(self, wait: bool = True) -> None:
        if not self.closed:  # as BatchStream: the call ends, on_end says None
            self.closed = True
            self._on_end(self, None)

    def deliver(self, index: int) -> None:
        self._on_batch(self, index, f"batch {index} from {self.address}")

    def refuse(self, index: int, code: grpc.StatusCode) -> None:
        self._on_batch(self, index, RemoteError(code, "refused", self.address))

    def fail(self, code: grpc.StatusCode, details: str = "stream broke") -> None:
        self._on_end(self, RemoteError(code, details, self.address))


class Streams:
    """The stream factory: every stream it opened, per server."""

    def __init__(self) -> None:
        self.opened: list[FakeStream] = []

    def __call__(self, *args: Any) -> FakeStream:
        stream = FakeStream(*args)
        self.opened.append(stream)
        return stream

    def of(self, address: str) -> list[FakeStream]:
        return [s for s in self.opened if s.address == address]

    def last(self, address: str) -> FakeStream:
        return self.of(address)[-1]


class Channel:
    def close(self) -> None:
        pass


def unused(*args: Any) -> Any:
    raise AssertionError("a fake stream assembles nothing")


@pytest.fixture
def run() -> Any:
    """(clock, streams, servers, scheduler) for 20 batches from servers a and b, window 4."""
    made: list[tuple[ServerSet, Scheduler]] = []

    def start(addresses: tuple[str, ...] = (A, B), total: int = 20, window: int = 4,
              resolver: Any = None) -> tuple[Clock, Streams, ServerSet, Scheduler]:
        """`resolver`: the servers are a dns target's, resolved by it (every 0.05 s)."""
        clock, streams = Clock(), Streams()
        servers = (ServerSet(list(addresses), channel=lambda address, options: Channel())
                   if resolver is None else
                   ServerSet("dns:///toy:1", channel=lambda address, options: Channel(),
                             resolver=resolver, dns_refresh=0.05))
        spec = StreamSpec(pb.Coordinates(dataset="toy", batch_size=2, world_size=1),
                          allocate=unused, finish=unused)
        scheduler = Scheduler(servers, spec, total=total, start=0, window=window,
                              timeout=TIMEOUT, stream_factory=streams, clock=clock)
        made.append((servers, scheduler))
        return clock, streams, servers, scheduler

    yield start
    for servers, scheduler in made:
        scheduler.close()
        servers.close()


def state(servers: ServerSet, address: str) -> dict[str, Any]:
    return servers.servers[address].stats()


def test_the_window_is_spread_over_the_servers(run) -> None:
    _, streams, _, _ = run()
    assert streams.last(A).credits == [0, 2] and streams.last(B).credits == [1, 3]


def test_a_widened_window_asks_for_new_batches_in_groups(run) -> None:
    _, streams, _, sched = run(addresses=(A,), total=24, window=4)
    a = streams.last(A)
    assert a.records == [[0, 1, 2, 3]]  # what is due goes in one record
    sched.widen(16)  # new ones in groups of 16 // GROUPS = 2 from now on
    assert a.records[1:] == [list(range(4, 16))]
    for k in range(5):
        a.deliver(k)
        sched.take(k)
    # Each take makes one more index due: they go two by two while the server holds
    # credits (the fifth waits for a partner).
    assert a.records[2:] == [[16, 17], [18, 19]]
    for k in range(5, 20):
        a.deliver(k)
    for k in range(5, 20):
        sched.take(k)
    # The epoch's tail goes as it comes due, group or not: nothing is left waiting.
    assert a.credits == list(range(24))


def test_a_stalled_servers_batches_are_asked_elsewhere_and_it_gets_only_probes_until_it_delivers(
        run) -> None:
    clock, streams, servers, sched = run()
    a, b = streams.last(A), streams.last(B)
    a.deliver(0)
    a.deliver(2)
    assert sched.take(0) == "batch 0 from a:1"
    assert a.credits == [0, 2, 4]  # b holds 1 and 3 and says nothing from now on
    clock.at(1.0)
    a.deliver(4)  # a keeps delivering

    clock.at(STALL_MIN - EPS)
    assert not sched.poll(1, T0)
    assert 3 not in a.credits and sched.failovers == 0  # (1, awaited, was hedged)
    assert state(servers, B)["state"] == "up"

    clock.at(STALL_MIN + EPS)
    assert not sched.poll(1, T0)
    assert a.credits[-1] == 3 and sched.failovers == 1
    assert state(servers, B)["state"] == "stalled"

    for k in (1, 3):
        a.deliver(k)
    for k in (1, 2, 3):
        sched.take(k)
    assert b.credits == [1, 3]  # stalled: nothing new
    assert a.credits[-3:] == [5, 6, 7]
    clock.at(STALL_MIN + PROBE_EVERY + 2 * EPS)  # but a probe now and then, one at a time
    sched.take(4)
    assert b.credits == [1, 3, 8]
    assert not sched.poll(5, T0)
    assert b.credits == [1, 3, 8]  # one probe at a time

    b.deliver(3)  # late: dropped, but b is alive again
    assert state(servers, B)["state"] == "up" and state(servers, B)["batches"] == 0


def test_a_stalled_server_gets_one_probe_beyond_what_it_held() -> None:
    """Probes of a silent server stop at one beyond what it held when it stalled: woken up,
    it must not find more credits than a window's (a server refuses more than max_credits)."""
    server = Server(B, Channel(), outstanding={1: T0, 3: T0})
    server.mark_stalled(T0 + STALL_MIN)
    probe_at = T0 + STALL_MIN + PROBE_EVERY
    assert not server.usable(probe_at - EPS) and server.usable(probe_at)
    server.outstanding[8] = probe_at  # the probe
    assert not any(server.usable(probe_at + k * PROBE_EVERY) for k in range(1, 20))
    server.mark_delivered(3, probe_at + 1)  # it answers: up again, credited as any other
    assert server.up and server.usable(probe_at + 1)


def test_the_awaited_batch_is_hedged_once_after_hedge_min_and_the_late_duplicate_dropped(
        run) -> None:
    clock, streams, servers, sched = run((A, B, C))
    a, b, c = streams.last(A), streams.last(B), streams.last(C)
    assert (a.credits, b.credits, c.credits) == ([0, 3], [1], [2])
    a.deliver(0)
    sched.take(0)
    assert a.credits == [0, 3, 4]

    def asked_for_1() -> list[str]:
        return [s.address for s in streams.opened if 1 in s.credits]

    clock.at(HEDGE_MIN - EPS)
    assert not sched.poll(1, T0)
    assert asked_for_1() == [B] and sched.hedges == 0

    clock.at(HEDGE_MIN + EPS)
    assert not sched.poll(1, T0)
    assert asked_for_1() == [B, C] and sched.hedges == 1  # c holds fewest
    assert state(servers, B)["state"] == "up"  # a hedge is not a failover
    assert sched.failovers == 0

    clock.at(HEDGE_MIN * 3)  # once is enough, though a is free to ask too
    assert not sched.poll(1, T0)
    assert asked_for_1() == [B, C] and sched.hedges == 1

    c.deliver(1)
    assert sched.take(1) == "batch 1 from c:1"
    b.deliver(1)  # the duplicate
    assert state(servers, B)["batches"] == 0  # counted nowhere, handed out never
    assert state(servers, C)["batches"] == 1


def test_a_loop_that_never_waits_still_sees_a_server_leave_its_name(run) -> None:
    # Every batch is ready before the loop asks for it, so take() never waits (and never
    # polls): the dns name is still re-resolved, and b, off it, gets no new credit.
    listed = [A, B]
    clock, streams, servers, sched = run(total=40, window=4, resolver=lambda t: list(listed))

    def answer_all() -> None:
        for address in (A, B):
            stream = streams.last(address)
            for k in stream.credits:
                stream.deliver(k)  # answered twice: the second is a dropped duplicate

    answer_all()
    sched.take(0)
    listed.remove(B)
    clock.at(1.0)  # past dns_refresh
    for i in range(1, 40):
        answer_all()
        assert i in sched._ready  # the loop does not wait
        sched.take(i)
    assert state(servers, B)["state"] == "gone"
    assert max(streams.last(B).credits) < 8  # nothing new once it left


def test_a_failed_streams_batches_go_to_the_other_and_it_is_retried_after_its_backoff(
        run) -> None:
    clock, streams, servers, sched = run()
    a, b = streams.last(A), streams.last(B)
    b.fail(grpc.StatusCode.UNAVAILABLE)
    assert a.credits == [0, 2, 1, 3] and sched.failovers == 1
    assert state(servers, B)["state"] == "down" and state(servers, B)["errors"] == 1

    for k in range(4):
        a.deliver(k)
    clock.at(BACKOFF_FIRST - EPS)
    sched.take(0)
    assert a.credits[-1] == 4 and len(streams.of(B)) == 1  # not yet

    clock.at(BACKOFF_FIRST + EPS)
    sched.take(1)
    assert len(streams.of(B)) == 2 and streams.last(B).credits == [5]
    assert state(servers, B)["state"] == "up"

    # It fails again at once, having delivered nothing: the backoff doubled.
    streams.last(B).fail(grpc.StatusCode.UNAVAILABLE)
    failed_at = clock.now - T0
    assert a.credits[-1] == 5
    a.deliver(4)
    a.deliver(5)
    clock.at(failed_at + 2 * BACKOFF_FIRST - EPS)
    sched.take(2)
    assert a.credits[-1] == 6 and len(streams.of(B)) == 2
    clock.at(failed_at + 2 * BACKOFF_FIRST + EPS)
    sched.take(3)
    assert len(streams.of(B)) == 3 and streams.last(B).credits == [7]


def test_an_in_band_unavailable_sends_that_batch_elsewhere_and_the_server_drains(run) -> None:
    clock, streams, servers, sched = run()
    a, b = streams.last(A), streams.last(B)
    b.refuse(1, grpc.StatusCode.UNAVAILABLE)
    # 1 goes to a; so does 3, which b still holds, since b is no longer up.
    assert a.credits == [0, 2, 1, 3]
    assert state(servers, B)["state"] == "draining"

    for k in (0, 1, 2):
        a.deliver(k)
    sched.take(0)
    sched.take(1)
    assert b.credits == [1, 3] and a.credits[-2:] == [4, 5]  # draining: nothing new

    b.deliver(3)  # its last one, before a's: let go, retried after DRAIN_RETRY
    assert b.closed
    assert state(servers, B)["state"] == "down"
    assert state(servers, B)["last_error"] == "draining"
    sched.take(2)
    assert sched.take(3) == "batch 3 from b:1"

    a.deliver(4)
    clock.at(DRAIN_RETRY - EPS)
    sched.take(4)
    assert len(streams.of(B)) == 1
    a.deliver(5)
    clock.at(DRAIN_RETRY + EPS)
    sched.take(5)
    assert len(streams.of(B)) == 2 and state(servers, B)["state"] == "up"


def test_a_fatal_stream_error_is_raised(run) -> None:
    _, streams, _, sched = run()
    streams.last(B).fail(grpc.StatusCode.NOT_FOUND, "no dataset 'toy'")
    with pytest.raises(RemoteError) as err:
        sched.poll(0, T0)
    assert err.value.code == grpc.StatusCode.NOT_FOUND and err.value.address == B


def test_an_in_band_internal_is_retried_batch_retries_times_and_data_loss_is_raised(
        run) -> None:
    _, streams, _, sched = run()
    a, b = streams.last(A), streams.last(B)
    # A worker died (or hung): asked again, each time of the other server than the one
    # that failed it (issue 19: the retry goes elsewhere when another server is usable).
    failing, other = a, b
    for attempt in range(BATCH_RETRIES):
        before = other.credits.count(0)
        failing.refuse(0, grpc.StatusCode.INTERNAL)
        assert other.credits.count(0) == before + 1
        assert a.credits.count(0) + b.credits.count(0) == attempt + 2
        failing, other = other, failing
    failing.refuse(0, grpc.StatusCode.INTERNAL)
    assert a.credits.count(0) + b.credits.count(0) == BATCH_RETRIES + 1
    with pytest.raises(RemoteError) as err:
        sched.take(0)
    assert err.value.code == grpc.StatusCode.INTERNAL

    b.refuse(1, grpc.StatusCode.DATA_LOSS)  # any server would say so: not asked again
    assert a.credits.count(1) == 0 and b.credits.count(1) == 1
    with pytest.raises(RemoteError) as err:
        sched.take(1)
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_an_in_band_internal_goes_to_another_usable_server_else_to_the_same(run) -> None:
    clock, streams, servers, sched = run((A, B, C))
    a, b, c = streams.last(A), streams.last(B), streams.last(C)
    assert (a.credits, b.credits, c.credits) == ([0, 3], [1], [2])
    a.refuse(0, grpc.StatusCode.INTERNAL)  # a hung worker there: not a again
    assert a.credits.count(0) == 1
    assert [s.address for s in streams.opened if 0 in s.credits] == [A, B]  # b holds fewest
    assert state(servers, A)["state"] == "up"  # one bad batch: a keeps its other credits
    b.deliver(0)
    assert sched.take(0) == "batch 0 from b:1"

    # With the others down (not usable), the retry goes back to the server that failed it.
    clock.at(1.0)
    b.fail(grpc.StatusCode.UNAVAILABLE)
    c.fail(grpc.StatusCode.UNAVAILABLE)
    assert state(servers, B)["state"] == state(servers, C)["state"] == "down"
    a.refuse(3, grpc.StatusCode.INTERNAL)
    assert a.credits.count(3) == 2
    assert len(streams.of(B)) == len(streams.of(C)) == 1  # not reopened: in their backoff


def test_no_progress_for_timeout_seconds_is_an_error_naming_every_server(run) -> None:
    clock, streams, _, sched = run()
    streams.last(B).fail(grpc.StatusCode.UNAVAILABLE, "connection refused")
    clock.at(1.0)
    assert not sched.poll(0, T0)
    assert streams.last(B).credits == [0]  # a hedge opened b again, past its backoff
    clock.at(STALL_MIN + 1.0)  # a stalls; b takes the rest
    assert not sched.poll(0, T0)
    assert streams.last(B).credits == [0, 1, 2, 3]
    clock.at(TIMEOUT)  # b stalls too
    assert not sched.poll(0, T0)
    # The loop began waiting late (it was elsewhere): its wait counts from then.
    clock.at(TIMEOUT + EPS)
    assert not sched.poll(0, T0 + 1.0)
    with pytest.raises(RemoteError) as err:
        sched.poll(0, T0)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(err.value) == (
        "a:1, b:1: UNAVAILABLE: no server delivered batch 0 within 30s of the last progress "
        "(a:1: stalled, last error: none; "
        "b:1: stalled, last error: b:1: UNAVAILABLE: connection refused)")


def test_a_server_still_answering_the_first_describe_has_its_share_kept_until_await_contact(
        run) -> None:
    """The loader starts at the first server that described the dataset; one still answering
    takes no credit, and for AWAIT_CONTACT s its share of the window is kept for it rather
    than piled on the first (which then built the window alone, and its late batches were
    hedged to the second: built twice)."""
    import concurrent.futures

    from stoker.client.fleet.policy import AWAIT_CONTACT

    def started(answered: bool) -> tuple[Clock, Streams, Scheduler, concurrent.futures.Future]:
        clock, streams = Clock(), Streams()
        servers = ServerSet([A, B], channel=lambda address, options: Channel())
        contact: concurrent.futures.Future = concurrent.futures.Future()
        if answered:
            contact.set_result(None)
        servers.servers[B].contact = contact
        spec = StreamSpec(pb.Coordinates(dataset="toy", batch_size=2, world_size=1),
                          allocate=unused, finish=unused)
        sched = Scheduler(servers, spec, total=20, start=0, window=4, timeout=TIMEOUT,
                          stream_factory=streams, clock=clock)
        return clock, streams, sched, contact

    clock, streams, sched, contact = started(answered=False)
    assert streams.last(A).credits == [0, 1] and not streams.of(B)  # B's two kept
    clock.at(AWAIT_CONTACT - EPS)
    assert not sched.poll(0, clock())
    assert streams.last(A).credits == [0, 1] and not streams.of(B)
    contact.set_result(None)  # B answers: its share goes to it
    assert not sched.poll(0, clock())
    assert streams.last(A).credits == [0, 1] and streams.last(B).credits == [2, 3]
    sched.close()

    clock, streams, sched, contact = started(answered=False)
    clock.at(AWAIT_CONTACT + EPS)  # B never answered: A takes the whole window
    assert not sched.poll(0, clock())
    assert streams.last(A).credits == [0, 1, 2, 3] and not streams.of(B)
    sched.close()

    _, streams, sched, _ = started(answered=True)  # B answered before the first credits
    assert streams.last(A).credits == [0, 2] and streams.last(B).credits == [1, 3]
    sched.close()
