"""The client's policy, decision by decision: crediting and hedging (fleet/policy.py) and the
ledger that applies them (fleet/credits.py), rates (fleet/rates.py), the window
(fleet/window.py), the backoff (_backoff.py), resume (position/resume.py) and the passes
(fleet/passes.py).

No server, no thread, no real time: servers are plain `Server` values, streams are fakes that
record their credits, the clock is a number. Each test asserts a decision that a deliberate
change of the policy breaks (the ones tried are in the issue's note, /work/notes/39.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
import pytest

from stoker.client import RemoteError
from stoker.client._backoff import Backoff
from stoker.client.fleet import policy
from stoker.client.fleet.credits import Credits
from stoker.client.fleet.passes import Pass, Passes
from stoker.client.fleet.rates import FORGET, MEASURED, Rate
from stoker.client.fleet.servers import Server, ServerState
from stoker.client.fleet.window import MAX_CREDITS, Fleet, Window, credit_window
from stoker.client.position.resume import Coordinates, Position, Saved, state_of
from stoker.client.transport.stream import StreamSpec
from stoker.v1 import stoker_pb2 as pb

NOW = 100.0


def server(address: str, outstanding: dict[int, float] | None = None, *,
           latency: float | None = None, state: ServerState = ServerState.UP) -> Server:
    s = Server(address, None)  # no channel: nothing is called
    s.outstanding = dict(outstanding or {})
    s.latency, s.state = latency, state
    return s


class FakeStream:
    """A stream (transport/stream.py's Stream) that records the credits it is sent."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.capacity: tuple[int, float] | None = None
        self.bytes_received = 0
        self.records: list[list[int]] = []

    def credit(self, batch_indices: Iterable[int]) -> None:
        self.records.append(list(batch_indices))

    def report(self, wait_seconds: float, loop_seconds: float,
               window: tuple[int, str, int] = (0, "", 0)) -> None:
        pass

    def close(self, wait: bool = True) -> None:
        pass


def unused(*args: Any) -> Any:
    raise AssertionError("no batch is assembled here")


class Opened:
    """The stream factory of a Credits ledger: one FakeStream per open."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []

    def __call__(self, channel: Any, address: str, *rest: Any) -> FakeStream:
        self.streams.append(FakeStream(address))
        return self.streams[-1]


class Set:
    """What Credits reads of a ServerSet: its servers by address."""

    def __init__(self, *servers: Server) -> None:
        self.servers = {s.address: s for s in servers}


def ledger(*servers: Server, total: int = 100) -> tuple[Credits, Opened]:
    opened = Opened()
    spec = StreamSpec(pb.Coordinates(), unused, unused)
    passes = Passes(Pass(spec, 0, 0, total))
    return Credits(Set(*servers), passes, opened, unused, unused), opened  # type: ignore[arg-type]  # a fake ServerSet


# -- crediting: who is asked ----------------------------------------------------------------

def test_pick_takes_the_fewest_outstanding_at_equal_cost() -> None:
    a, b = server("a", {1: NOW, 2: NOW}), server("b", {3: NOW})
    assert policy.pick([a, b], {a: 1.0, b: 1.0}, NOW) is b


def test_pick_weighs_outstanding_by_seconds_per_batch() -> None:
    # a: (2 + 1) x 1.0 = 3 s; b: (0 + 1) x 4.0 = 4 s: the busier fast one delivers sooner
    a, b = server("a", {1: NOW, 2: NOW}), server("b")
    assert policy.pick([a, b], {a: 1.0, b: 4.0}, NOW) is a


def test_pick_breaks_ties_by_lower_latency() -> None:
    a, b = server("a", latency=0.5), server("b", latency=0.1)
    assert policy.pick([a, b], {a: 1.0, b: 1.0}, NOW) is b


def test_pick_skips_the_excluded() -> None:
    a, b = server("a"), server("b", {1: NOW, 2: NOW, 3: NOW})
    assert policy.pick([a, b], {a: 1.0, b: 1.0}, NOW, exclude={a}) is b


def test_pick_skips_a_down_server_until_its_retry() -> None:
    a = server("a", state=ServerState.DOWN)
    a.retry_at = NOW + 1
    assert policy.pick([a], {a: 1.0}, NOW) is None
    assert policy.pick([a], {a: 1.0}, NOW + 1) is a


def test_pick_gives_a_stalled_server_one_probe_at_most() -> None:
    a = server("a", {1: NOW - 10}, state=ServerState.STALLED)
    a.held_at_stall, a.retry_at = 1, NOW - 5
    assert policy.pick([a], {a: 1.0}, NOW) is a  # one beyond what it held when it stalled
    a.outstanding[2] = NOW
    assert policy.pick([a], {a: 1.0}, NOW + 100) is None


def test_pick_returns_none_without_candidates() -> None:
    assert policy.pick([], {}, NOW) is None


def test_due_lists_new_and_failed_over_positions() -> None:
    up, down = server("a"), server("b", state=ServerState.DOWN)
    new, failed = policy.due(0, 5, ready={0}, holders={1: {up}, 2: {down}, 3: {down, up}})
    assert new == [4]
    assert failed == [2]


def test_due_stays_inside_the_window() -> None:
    new, failed = policy.due(3, 6, ready=set(), holders={})
    assert (new, failed) == ([3, 4, 5], [])


def test_hold_back_waits_for_a_group_while_servers_hold_credits() -> None:
    busy = server("a", {5: NOW})
    assert policy.hold_back([7, 8], group=4, start=5, end=9, last=100, servers=[busy])


@pytest.mark.parametrize("case", ["the next one", "a full group", "the end", "idle servers"])
def test_hold_back_sends_at_once(case: str) -> None:
    busy, idle = server("a", {5: NOW}), server("b")
    new, group, end, servers = [7, 8], 4, 9, [busy]
    if case == "the next one":
        new = [5, 6]
    elif case == "a full group":
        group = 2
    elif case == "the end":
        end = 100
    else:
        servers = [idle]
    assert not policy.hold_back(new, group, 5, end, 100, servers)


@pytest.mark.parametrize(("window", "group"), [(1, 1), (8, 1), (15, 1), (16, 2), (64, 8)])
def test_group_for_is_an_eighth_of_the_window(window: int, group: int) -> None:
    assert policy.group_for(window) == group


# -- costs: what a credit costs where ------------------------------------------------------

def measured(s: Server, seconds_per_batch: float, batches: int = 8, nbytes: int = 0) -> Server:
    s.rate = Rate(batches=batches, nbytes=nbytes, seconds=batches * seconds_per_batch,
                  delivered_count=batches)
    return s


def test_costs_without_measures_are_one_each() -> None:
    a, b = server("a"), server("b")
    assert policy.costs([a, b], NOW) == {a: 1.0, b: 1.0}


def test_costs_take_an_unmeasured_server_for_the_fastest() -> None:
    a, b, c = measured(server("a"), 0.5), measured(server("b"), 2.0), server("c")
    cost = policy.costs([a, b, c], NOW)
    assert cost[a] == pytest.approx(0.5) and cost[b] == pytest.approx(2.0)
    assert cost[c] == pytest.approx(0.5)


def test_costs_count_what_an_unmeasured_server_has_shown() -> None:
    a = measured(server("a", latency=0.1), 0.5)
    c = server("c", {1: NOW - 3.0})
    c.rate.busy(NOW - 3.0)  # 3 s holding its first credit, longer than FIRST x 0.1 s
    assert policy.costs([a, c], NOW)[c] == pytest.approx(3.0)


def test_costs_count_bytes_on_a_slow_link() -> None:
    # b delivers batches fast but its bytes slowly: at the fleet's mean batch size it is slow
    a = measured(server("a"), 1.0, nbytes=8 * 1000)
    b = measured(server("b"), 0.1, nbytes=8 * 10)
    cost = policy.costs([a, b], NOW)
    assert cost[b] > cost[a]


# -- hedging --------------------------------------------------------------------------------

def test_late_finds_a_slow_servers_batch_the_loop_needs_first() -> None:
    fast, slow = server("fast"), server("slow", {10: NOW, 11: NOW})
    holders = {10: {slow}, 11: {slow}}
    found = policy.late([fast, slow], {fast: 1.0, slow: 10.0}, 10, holders, hedged=set())
    assert [(s.address, i) for s, i, _ in found] == [("slow", 10), ("slow", 11)]
    assert found[0][2] == pytest.approx(10.0)  # (rank 0 + 1) x 10 s


def test_late_compares_with_the_time_the_loop_needs_it() -> None:
    fast, slow = server("fast"), server("slow", {10: NOW})
    # needed at 10 / (1/0.5 + 1/10) = 4.8 s; expected at 10 s: late
    assert policy.late([fast, slow], {fast: 0.5, slow: 10.0}, 0, {10: {slow}}, set())


def test_late_leaves_a_batch_that_comes_in_time() -> None:
    fast, slow = server("fast"), server("slow", {50: NOW})
    # needed at (50 - 10) / (1/1 + 1/10) = 36 s; expected at 10 s
    assert policy.late([fast, slow], {fast: 1.0, slow: 10.0}, 10, {50: {slow}}, set()) == []


def test_late_needs_a_server_slower_than_slow_times_the_fastest() -> None:
    fast, slow = server("fast"), server("slow", {10: NOW})
    cost = {fast: 1.0, slow: policy.SLOW}  # exactly SLOW times: not slow
    assert policy.late([fast, slow], cost, 10, {10: {slow}}, set()) == []
    cost[slow] = policy.SLOW * 1.01
    assert policy.late([fast, slow], cost, 10, {10: {slow}}, set())


def test_late_skips_hedged_and_doubly_held_batches() -> None:
    fast, slow = server("fast"), server("slow", {10: NOW, 11: NOW, 12: NOW})
    holders = {10: {slow}, 11: {slow, fast}}  # 12 delivered (no holders)
    found = policy.late([fast, slow], {fast: 1.0, slow: 10.0}, 10, holders, hedged={10})
    assert found == []


def test_late_needs_two_servers_up() -> None:
    slow = server("slow", {10: NOW})
    other = server("other", state=ServerState.DOWN)
    assert policy.late([slow, other], {slow: 10.0, other: 1.0}, 10, {10: {slow}}, set()) == []


def test_sooner_only_when_it_beats_the_expected_time() -> None:
    a = server("a", {1: NOW, 2: NOW})  # (2 + 1) x 1.0 = 3 s
    assert policy.sooner([a], {a: 1.0}, NOW, (), expected=3.5) is a
    assert policy.sooner([a], {a: 1.0}, NOW, (), expected=3.0) is None


def test_hedge_awaited_after_hedge_min() -> None:
    a = server("a", {7: NOW})
    assert not policy.hedge_awaited(7, {a}, set(), [a], NOW + policy.HEDGE_MIN)
    assert policy.hedge_awaited(7, {a}, set(), [a], NOW + policy.HEDGE_MIN + 0.01)


def test_hedge_awaited_waits_four_latencies_of_the_fastest() -> None:
    a = server("a", {7: NOW}, latency=1.0)
    assert not policy.hedge_awaited(7, {a}, set(), [a], NOW + 3.9)
    assert policy.hedge_awaited(7, {a}, set(), [a], NOW + 4.1)


def test_hedge_awaited_once() -> None:
    a = server("a", {7: NOW})
    assert not policy.hedge_awaited(7, {a}, {7}, [a], NOW + 60)
    assert not policy.hedge_awaited(7, set(), set(), [a], NOW + 60)  # held by none


def test_stalling_after_patience() -> None:
    a = server("a", {1: NOW})
    a.last_progress = NOW
    assert policy.stalling([a], NOW + policy.STALL_MIN) == []
    assert policy.stalling([a], NOW + policy.STALL_MIN + 0.01) == [a]


def test_stalling_patience_grows_with_latency() -> None:
    a = server("a", {1: NOW}, latency=1.0)
    a.last_progress = NOW
    assert policy.stalling([a], NOW + 9.9) == []
    assert policy.stalling([a], NOW + 10.1) == [a]


def test_stalling_needs_credits_held() -> None:
    a = server("a")
    assert policy.stalling([a], NOW + 1000) == []


@pytest.mark.parametrize(("code", "retries", "again"), [
    (grpc.StatusCode.UNAVAILABLE, 99, True), (grpc.StatusCode.INTERNAL, 1, True),
    (grpc.StatusCode.INTERNAL, 2, False), (grpc.StatusCode.DATA_LOSS, 0, False)])
def test_retried_errors(code: grpc.StatusCode, retries: int, again: bool) -> None:
    assert policy.retried(RemoteError(code, "x", "a"), retries, 2) is again


def test_a_batch_is_never_retried() -> None:
    assert not policy.retried({"x": 1}, 0, 2)


# -- the ledger applies the decisions -------------------------------------------------------

def test_assign_sends_one_record_per_stream() -> None:
    a, b = server("a"), server("b")
    credits, opened = ledger(a, b)
    credits.assign(NOW, 0, 4, 1, ready=set())
    assert sorted(r for s in opened.streams for r in s.records[0]) == [0, 1, 2, 3]
    assert [len(s.records) for s in opened.streams] == [1, 1]
    assert {len(a.outstanding), len(b.outstanding)} == {2}


def test_assign_fails_over_a_batch_whose_holder_is_down() -> None:
    a, b = server("a"), server("b")
    credits, _ = ledger(a, b)
    credits.assign(NOW, 0, 1, 1, ready=set())
    holder = next(iter(credits.holders[0]))
    other = b if holder is a else a
    holder.state, holder.retry_at = ServerState.DOWN, NOW + 60
    credits.assign(NOW, 0, 1, 1, ready=set())
    assert credits.holders[0] == {holder, other}
    assert 0 in other.outstanding


def test_hedge_late_asks_the_fast_server_and_counts_it() -> None:
    fast, slow = measured(server("fast"), 1.0), measured(server("slow"), 10.0)
    credits, _ = ledger(fast, slow)
    credits.send(slow, 0, NOW)
    credits.hedge_late(NOW, 0)
    assert credits.holders[0] == {slow, fast}
    assert credits.hedges == 1 and slow.hedged == 1 and credits.hedged == {0}


def test_hedge_late_never_asks_a_stalled_server() -> None:
    slow = measured(server("slow"), 10.0)
    busy = measured(server("busy", dict.fromkeys(range(100, 110), NOW)), 1.0)  # 11 s away
    stalled = measured(server("stalled"), 1.0)  # idle, 1 s away: a hedge would go there
    credits, _ = ledger(slow, busy, stalled)
    credits.send(slow, 0, NOW)
    stalled.state, stalled.retry_at = ServerState.STALLED, 0.0
    credits.hedge_late(NOW, 0)
    assert credits.hedges == 0 and credits.holders[0] == {slow}


def test_retry_internal_goes_to_another_server_first() -> None:
    a, b = server("a"), server("b")
    credits, _ = ledger(a, b)
    credits.send(a, 0, NOW)
    error = RemoteError(grpc.StatusCode.INTERNAL, "worker died", "a")
    assert credits.retry(0, a, error, NOW, limit=2)
    assert credits.holders[0] == {b}


def test_lost_puts_back_what_the_server_held() -> None:
    a = server("a")
    credits, _ = ledger(a)
    credits.send(a, 0, NOW)
    credits.send(a, 1, NOW)
    credits.lost(a, RemoteError(grpc.StatusCode.UNAVAILABLE, "gone", "a"), NOW)
    assert credits.holders == {0: set(), 1: set()}
    assert a.state is ServerState.DOWN and not a.outstanding


def test_costs_are_computed_once_per_instant() -> None:
    a = server("a")
    credits, _ = ledger(a)
    first = credits.costs(NOW)
    assert credits.costs(NOW) is first
    credits.forget()
    assert credits.costs(NOW) is not first


# -- rates ----------------------------------------------------------------------------------

def test_a_rate_counts_after_measured_batches() -> None:
    rate = Rate()
    rate.busy(0.0)
    for k in range(1, MEASURED):
        rate.delivered(k * 0.1, "s", k * 100, busy=True)
    assert rate.batches_per_second is None
    rate.delivered(MEASURED * 0.1, "s", MEASURED * 100, busy=True)
    assert rate.batches_per_second == pytest.approx(10.0, rel=0.05)


def test_a_rate_is_forgotten_after_forget_seconds_idle() -> None:
    rate = Rate()
    rate.busy(0.0)
    rate.delivered(1.0, "s", 100, busy=False)
    assert not rate.stale(1.0 + FORGET - 0.01)
    assert rate.stale(1.0 + FORGET)


def test_a_rate_counts_only_new_bytes_of_a_stream() -> None:
    rate = Rate()
    rate.busy(0.0)
    rate.delivered(1.0, "s", 1000, busy=True)
    rate.delivered(2.0, "s", 1500, busy=True)
    assert rate.nbytes == pytest.approx(1000 * 0.5 ** (1 / 2.0) + 500)


# -- the window -----------------------------------------------------------------------------

def test_credit_window_stays_under_max_credits() -> None:
    assert credit_window(10, 4, "a") == 4
    assert credit_window(10, 0, "a") == 10  # the server did not say


def test_cap_credits_lowers_the_floor_and_the_cap() -> None:
    w = Window(10)
    w.cap_credits(6, "a")
    assert (w.size, w.floor, w.max_credits) == (6, 6, 6)
    w.cap_credits(0, "b")
    assert w.max_credits == 6


def test_fit_widens_for_small_batches_up_to_half_max_credits() -> None:
    w = Window(4)
    w.batch_bytes = 1000
    assert w.fit(prefetch_bytes=1_000_000) == MAX_CREDITS // 2
    assert w.widened and w.floor == MAX_CREDITS // 2


def test_fit_leaves_large_batches_alone() -> None:
    w = Window(4)
    w.batch_bytes = 1 << 20
    assert w.fit(prefetch_bytes=2 << 20) is None and w.size == 4


def test_start_sizes_an_adapting_window_for_the_workers() -> None:
    w = Window(2, adapts=True, memory_budget=1 << 30)
    w.start(Fleet(8, 0.0, None))
    assert w.size == 8 * 1.25 + 2  # ceil(workers x MARGIN) + SPARE


def test_adapt_grows_a_stalled_window_within_the_budget() -> None:
    w = Window(4, adapts=True, memory_budget=10 * 1000)
    w.batch_bytes = 1000
    fleet = Fleet(2, 0.0, None)
    assert w.adapt(fleet, 10, wait=0.0, loop=0.0, taken=0) is None  # first look: a mark
    size = w.adapt(fleet, 10, wait=0.5, loop=2.0, taken=20)  # stalled 25%
    assert size is not None and 4 < size <= w.budget_batches


# -- backoff --------------------------------------------------------------------------------

def test_backoff_doubles_to_its_most_and_resets() -> None:
    b = Backoff(first=0.05, most=0.3)
    assert [b.next() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    b.reset()
    assert b.next() == 0.05


# -- resume and the passes ------------------------------------------------------------------

def coords(**kw: Any) -> Coordinates:
    base: dict[str, Any] = dict(dataset="d", seed=1, shuffle=True, rank=0, world_size=1,
                                batch_size=4, drop_last=False)
    return Coordinates(**{**base, **kw})


def test_a_saved_position_resumes_where_it_was() -> None:
    c = coords()
    state = state_of(c, Position(3, 0, 7), None)
    saved = Saved.read(state, c)
    assert saved.position_for(c, lambda s: 0) == Position(3, 0, 7)


def test_a_state_of_other_data_is_refused() -> None:
    state = state_of(coords(seed=2), Position(0, 0, 1), None)
    with pytest.raises(ValueError, match="seed"):
        Saved.read(state, coords(seed=1))


def test_passes_number_positions_across_epochs() -> None:
    spec = StreamSpec(pb.Coordinates(), unused, unused)
    passes = Passes(Pass(spec, 0, 0, 10))
    following = passes.add(spec, 6)
    assert following.base == 10 and passes.end == 16
    assert passes.of(12) is following and passes.of(9) is passes.loop
