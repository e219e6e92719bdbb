"""A slow server does not drag the fleet: its rate is learned, it gets fewer credits, and what
it would deliver late is hedged to a faster one (client/fleet/rates.py, client/fleet/policy.py).

Between real hosts (tests/hosts.py: network namespaces over veth links): every server on a
host of its own, one link slowed with tc tbf so that its server delivers about 20x fewer
samples/s than a fast one. The fleet with it must deliver >= 0.9x what the fast servers alone
deliver (measured in the same test, medians of epochs after a first), every sample exactly
once an epoch, in the same order as without it. And in-process, with a clock the test moves
(as tests/test_scheduler.py): the rate is learned per batch and per byte, credits follow it,
and a late batch is hedged once, early, its duplicate dropped.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import numpy as np
import pytest
from test_scheduler import EPS, T0, Channel, Clock, Streams, unused

from stoker.client import RemoteLoader
from stoker.client.fleet.policy import HEDGE_MIN
from stoker.client.fleet.rates import FORGET, Rate
from stoker.client.fleet.scheduler import Scheduler
from stoker.client.fleet.servers import ServerSet, ServerState
from stoker.client.transport.stream import StreamSpec
from stoker.v1 import stoker_pb2 as pb

from conftest import StartServer
from hosts import Host, hosts_or_skip

# serial: timing figures (waits, shares of a rate) that a second test process beside them would
# bend; `make test` runs them alone, after the rest in parallel.
pytestmark = [pytest.mark.timeout(120), pytest.mark.serial]

# 2 ms samples of about 500 bytes (x: 80 float32, tokens: 2 x 80 uint8), 8 a batch: a fast
# server with 2 workers builds ~1,000 samples/s; over 200 kbit/s (25 KB/s) a server sends
# ~50: about 20x slower, on its link alone.
N, BS, SEED, DIM, DELAY = 2000, 8, 5, 80, 0.002
SLOW_LINK = "200kbit"
EPOCHS = 4  # the first warms up (connections, the servers' first builds); the rest measured
RATIO_FLOOR = 0.8  # asserted (a shared 2-core CI box); the target is 0.9
# The ratio before slow servers were routed around (main at b337af9, this test's setup).
BEFORE = {1: 0.50, 2: 0.43}
DATASETS = {"toy": {"format": "python", "factory": "toy_datasets:toy",
                    "options": {"n": N, "dim": DIM, "delay": DELAY}}}
# shared_memory=False: the hosts share this machine's /dev/shm, which hosts apart do not.
KW: dict[str, Any] = dict(batch_size=BS, shuffle=True, order="legacy", output="numpy", timeout=30,
                          shared_memory=False)


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    hosts_or_skip()
    with ExitStack() as stack:
        yield [stack.enter_context(Host(i)) for i in (1, 2, 3)]


def reference(seed: int, epoch: int) -> list[int]:
    return np.random.default_rng([seed, epoch]).permutation(N).tolist()


def measure(addresses: list[str], seed: int
            ) -> tuple[float, float, list[list[int]], dict[str, Any]]:
    """Samples/s (median of the epochs after the first; and of the first), each epoch's
    sample indices in order, and the loader's stats at the end. Each measurement its own
    `seed`: servers keep the batches they built for a while and serve them again to the
    same coordinates (server/front/shared_batches.py), which would make a second
    measurement free."""
    seen: list[list[int]] = []
    rates = []
    with RemoteLoader(addresses, "toy", seed=seed, **KW) as loader:
        for _ in range(EPOCHS):
            got: list[int] = []
            began = time.perf_counter()
            for batch in loader:
                got += batch["sample_index"].tolist()
            rates.append(len(got) / (time.perf_counter() - began))
            seen.append(got)
        stats = loader.stats()
    return statistics.median(rates[1:]), rates[0], seen, stats


def lost_and_duplicated(ledger: Any, seen: list[list[int]], seed: int
                        ) -> tuple[int, int, bool]:
    lost = dup = 0
    in_order = True
    for epoch, got in enumerate(seen):
        epoch_lost, epoch_dup = ledger.compare(got, reference(seed, epoch))
        lost, dup = lost + epoch_lost, dup + epoch_dup
        in_order = in_order and got == reference(seed, epoch)
    return lost, dup, in_order


@pytest.mark.parametrize("fast", [1, 2])
def test_a_server_on_a_slow_link_does_not_drag_the_fleet(
        hosts: list[Host], start_server: StartServer, ledger: Any, fast: int) -> None:
    servers = [start_server(DATASETS, workers=2, wrap=h.wrap, host=h.ip)
               for h in hosts[: fast + 1]]
    slow_host, slow = hosts[fast], servers[fast]
    slow_host.slow(SLOW_LINK)
    alone, first_alone, seen_alone, _ = measure([s.address for s in servers[:fast]], SEED)
    with_slow, first, seen, stats = measure([s.address for s in servers], SEED + 1)
    ratio = with_slow / alone
    lost, dup, in_order = lost_and_duplicated(ledger, seen, SEED + 1)
    # What the loader learned of the slow server: its link's rate, and its samples/s.
    learned = stats["servers"][slow.address]
    slow_rate = (learned["batches_per_second"] or 0.0) * BS
    fast_rate = min((stats["servers"][s.address]["batches_per_second"] or 0.0) * BS
                    for s in servers[:fast])
    print(f"{fast} fast alone {alone:.0f} samples/s, with the slow one {with_slow:.0f}: "
          f"{ratio:.2f} (first epoch {first / first_alone:.2f}); the slow one learned at "
          f"{slow_rate:.0f} samples/s, the fast ones {fast_rate:.0f}; hedges "
          f"{stats['hedges']}; {stats['servers']}")
    assert lost_and_duplicated(ledger, seen_alone, SEED) == (0, 0, True)
    ledger.record("network", f"one of {fast + 1} servers' links slowed to {SLOW_LINK}, "
                  f"{EPOCHS} epochs", tried=EPOCHS, lost=lost, duplicated=dup,
                  detail=f"{with_slow:.0f} samples/s against {alone:.0f} from the {fast} "
                         f"fast one{'s' if fast > 1 else ''} alone: {ratio:.2f} (before: "
                         f"{BEFORE[fast]:.2f}; first epoch, rates not learned yet: "
                         f"{first / first_alone:.2f}); the slow one learned at "
                         f"{slow_rate:.0f} samples/s, {learned['batches']} of its batches "
                         f"used, {learned['hedged']} hedged")
    assert lost == dup == 0 and in_order
    # Learned per byte: the link's 25 KB/s (tbf lets a burst through), not the CPU's rate.
    assert (learned["bytes_per_second"] or 0) < 60_000, learned
    assert ratio >= RATIO_FLOOR, (alone, with_slow, stats)


# -- in-process: the scheduler against servers the test plays, on a clock it moves ----------

def simulate(seconds_per_batch: dict[str, float], total: int = 400, window: int = 32,
             batch_bytes: int = 1000, heal_at: float | None = None,
             times: list[float] | None = None
             ) -> tuple[float, float, list[str], Scheduler, ServerSet]:
    """The loop takes `total` batches as soon as each is in; each server works through its
    credits in order, one every `seconds_per_batch[address]` (from `heal_at` s on, every
    server as fast as the fastest), `batch_bytes` each. (Simulated seconds the loop took, its
    longest wait for a batch, who delivered each batch it took, the scheduler, its
    servers; and, into `times`, when it took each.)"""
    clock, streams = Clock(), Streams()
    servers = ServerSet(list(seconds_per_batch), channel=lambda address, options: Channel())
    spec = StreamSpec(pb.Coordinates(dataset="toy", batch_size=2, world_size=1),
                      allocate=unused, finish=unused)
    sched = Scheduler(servers, spec, total=total, start=0, window=window, timeout=30.0,
                      stream_factory=streams, clock=clock)
    done = dict.fromkeys(seconds_per_batch, 0)  # credits each server has answered
    due = {a: T0 + each for a, each in seconds_per_batch.items()}  # its next one done then
    taken: list[str] = []
    last, longest = T0, 0.0
    while len(taken) < total:
        clock.now += 0.001
        if heal_at is not None and clock.now - T0 >= heal_at:
            seconds_per_batch = dict.fromkeys(seconds_per_batch, min(seconds_per_batch.values()))
        for address, each in seconds_per_batch.items():
            stream = streams.last(address)
            if done[address] >= len(stream.credits):
                due[address] = clock.now + each  # idle: the next credit starts now
                continue
            while done[address] < len(stream.credits) and clock.now >= due[address]:
                stream.bytes_received += batch_bytes
                stream.deliver(stream.credits[done[address]])
                done[address] += 1
                due[address] += each
        while len(taken) < total and sched.poll(len(taken), clock.now):
            taken.append(sched.take(len(taken)).rsplit(" ", 1)[1])
            last, longest = clock.now, max(longest, clock.now - last)
            if times is not None:
                times.append(clock.now - T0)
    return clock.now - T0, longest, taken, sched, servers


@pytest.mark.parametrize("fast", [1, 2])
def test_credits_follow_the_rate_and_late_batches_are_hedged_early(fast: int) -> None:
    rates = {f"fast{k}:1": 0.01 for k in range(fast)}
    slow = "slow:1"
    at_alone: list[float] = []
    at: list[float] = []
    alone, *_ = simulate(rates, times=at_alone)
    took, longest, by, sched, servers = simulate({**rates, slow: 0.2}, times=at)  # 20x
    try:
        # Every batch once, in order (take() hands out positions in order; a duplicate would
        # be handed out nowhere). Once the rates are learned (after the first 100 batches),
        # the fleet is as fast as the fast servers alone; from the start, near enough.
        assert len(by) == 400
        steady = (at_alone[-1] - at_alone[99]) / (at[-1] - at[99])
        assert steady >= 0.95 and alone / took >= 0.8, (steady, alone, took)
        figures = servers.servers[slow].stats()
        assert figures["batches"] == by.count(slow)
        assert figures["batches_per_second"] == pytest.approx(5.0, rel=0.2)
        assert figures["bytes_per_second"] == pytest.approx(5000, rel=0.2)
        assert servers.servers["fast0:1"].stats()["batches_per_second"] > 50
        # Hedged early: the loop never waited as long as the wait-hedge's HEDGE_MIN; each
        # early hedge is counted on the server it was taken from (`hedges` counts the
        # wait-hedges too), and its duplicate came and was dropped.
        assert longest < HEDGE_MIN, longest
        assert sched.hedges >= figures["hedged"] > 0
        assert servers.servers[slow].rate.delivered_count > figures["batches"]
        if fast == 1:  # a window of 32 has batches due later than the slow one's 0.2 s
            assert by.count(slow) > 2, by.count(slow)
    finally:
        sched.close()
        servers.close()


def test_a_slow_server_that_recovers_gets_its_share_again() -> None:
    at: list[float] = []
    _, _, by, sched, servers = simulate({"fast:1": 0.01, "slow:1": 0.2}, total=3000,
                                        heal_at=2.0, times=at)
    try:
        slow = [b for b, t in zip(by, at, strict=True) if t < 2.0]
        healed = [b for b, t in zip(by, at, strict=True) if t > 4.0]
        assert slow.count("slow:1") < 0.05 * len(slow)
        assert healed and healed.count("slow:1") > 0.3 * len(healed)
    finally:
        sched.close()
        servers.close()


def test_a_rate_is_forgotten_after_forget_seconds_without_credits() -> None:
    """A slow server gets no credits, so it could never show that it recovered: its rate is
    forgotten FORGET s after its last credit was answered, and it is measured afresh."""
    rate = Rate()
    rate.busy(T0)
    for k in range(1, 6):
        rate.delivered(T0 + k * 0.1, "stream", k * 1000, busy=k < 5)
    assert rate.seconds_per_batch(1000, T0 + 0.5 + FORGET - EPS) == pytest.approx(0.1)
    assert rate.seconds_per_batch(1000, T0 + 0.5 + FORGET) is None
    rate.busy(T0 + 0.5 + FORGET)
    assert rate.delivered_count == 0 and rate.seconds_per_batch(1000) is None


def test_an_outage_is_not_a_rate() -> None:
    """A server measured at 0.01 s a batch that then delivers nothing for a second (frozen,
    cut off) and comes back is measured afresh, not taken for 100x slower."""
    rate = Rate()
    rate.busy(T0)
    for k in range(1, 51):
        rate.delivered(T0 + k * 0.01, "stream", k * 1000, busy=True)
    assert rate.seconds_per_batch(1000) == pytest.approx(0.01)
    rate.delivered(T0 + 0.5 + 1.0, "stream", 51_000, busy=True)  # after the outage
    assert rate.delivered_count == 1 and rate.seconds_per_batch(1000) is None
    for k in range(1, 31):
        rate.delivered(T0 + 1.5 + k * 0.01, "stream", (51 + k) * 1000, busy=True)
    assert rate.seconds_per_batch(1000) == pytest.approx(0.01, rel=0.1)


def test_a_server_slower_than_the_outage_floor_is_measured() -> None:
    """A server that takes 0.6 s a batch (longer than OUTAGE_MIN) is measured at 0.6 s,
    not taken for an outage at each batch and left unmeasured (costed as the fastest)."""
    rate = Rate()
    rate.busy(T0)
    for k in range(1, 11):
        rate.delivered(T0 + k * 0.6, "stream", k * 1000, busy=True)
    assert rate.seconds_per_batch(1000) == pytest.approx(0.6)
    assert rate.batches_per_second == pytest.approx(1 / 0.6)


def test_after_a_forget_a_delivery_counts_only_its_own_bytes() -> None:
    """A rate forgotten (a stall, FORGET) while its stream stays open: the next batch on
    that stream adds its own bytes, not all the stream delivered since it opened (which
    would take a slow link for a fast one, and inflate the fleet's mean batch)."""
    rate = Rate()
    rate.busy(T0)
    for k in range(1, 11):
        rate.delivered(T0 + k * 0.1, "stream", k * 1_000_000, busy=True)
    rate.forget()
    rate.busy(T0 + 5)
    rate.delivered(T0 + 5.1, "stream", 11_000_000, busy=True)
    assert rate.nbytes == 1_000_000


def test_a_probe_of_a_stalled_server_on_a_new_stream_leaves_it_stalled() -> None:
    """A stalled server whose probe opens a stream (the epoch it stalled in was let go) is
    not up until it delivers: others still take what it holds."""
    servers = ServerSet(["a:1"], channel=lambda address, options: Channel())
    server = servers.servers["a:1"]
    server.outstanding[0] = T0
    server.mark_stalled(T0 + 1)
    server.mark_up(1, object())  # type: ignore[arg-type]
    assert server.state is ServerState.STALLED
    server.mark_delivered(0, T0 + 2)
    assert server.state is ServerState.UP
    server.let_go()  # the stand-in stream has nothing to close
    servers.close()


def test_the_rate_is_per_batch_and_per_byte() -> None:
    """One server delivers 10 batches a second of 1,000 bytes (short of CPU); the other
    100 a second of 100 bytes (10 KB/s: a link that small batches do not fill). For a 1,000-
    byte batch both take 0.1 s: the first by its batches/s, the second by its bytes/s."""
    cpu, link = Rate(), Rate()
    for rate, every, nbytes in ((cpu, 0.1, 1000), (link, 0.01, 100)):
        rate.busy(T0)
        assert rate.seconds_per_batch(1000) is None
        for k in range(1, 101):
            rate.delivered(T0 + k * every, "stream", k * nbytes, busy=True)
    assert cpu.seconds_per_batch(1000) == pytest.approx(0.1)
    assert cpu.seconds_per_batch(100) == pytest.approx(0.1)  # its batches/s bound it
    assert link.seconds_per_batch(100) == pytest.approx(0.01)
    assert link.seconds_per_batch(1000) == pytest.approx(0.1)  # its bytes/s bound it
    assert (cpu.batches_per_second, link.bytes_per_second) == (
        pytest.approx(10), pytest.approx(10_000))
