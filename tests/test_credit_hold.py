"""Credits held a moment after a take (client/fleet/hold.py): only where the loop has batches
in hand and is slow enough for a hold to matter, sent once for every take held together, never
after close; and a Scheduler that holds them sends a take's credits from the hold's thread."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from stoker.client.fleet.hold import HOLD_MAX, HOLD_MIN, SLACK, CreditHold
from stoker.client.fleet.scheduler import Scheduler
from stoker.client.fleet.servers import ServerSet
from stoker.client.transport.stream import StreamSpec
from stoker.v1 import stoker_pb2 as pb

pytestmark = pytest.mark.timeout(30)
STEP = 0.042  # s between takes: a 40 ms training step (hold: STEP / 3)


class Sends:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.times: list[float] = []
        self.sent = threading.Event()

    def __call__(self) -> None:  # called under self.lock by the hold's thread
        self.times.append(time.monotonic())
        self.sent.set()


def test_no_hold_without_batches_in_hand_or_for_a_fast_loop() -> None:
    sends = Sends()
    hold = CreditHold(sends.lock, sends)
    assert not hold.holds(0.0, in_hand=10)  # the first take: no time between takes yet
    assert not hold.holds(STEP, in_hand=SLACK - 1)  # it may wait soon: at once
    fast = CreditHold(sends.lock, sends)
    for k in range(20):  # batches every 3 HOLD_MIN or less: not worth a wake-up
        assert not fast.holds(k * 3 * HOLD_MIN * 0.9, in_hand=10)
    assert not sends.times


def test_takes_held_together_are_sent_once_after_the_hold() -> None:
    sends = Sends()
    hold = CreditHold(sends.lock, sends)
    assert not hold.holds(0.0, in_hand=SLACK)
    with sends.lock:  # the hold's thread cannot send before these three are in
        started = time.monotonic()
        assert hold.holds(STEP, in_hand=SLACK)
        assert hold.holds(STEP + 0.001, in_hand=SLACK)
        assert hold.holds(STEP + 0.002, in_hand=SLACK + 3)
    assert sends.sent.wait(10)
    assert sends.times[0] - started >= min(HOLD_MAX, STEP / 3) * 0.9
    time.sleep(3 * HOLD_MAX)  # simulated wait: time for a second send, which must not come
    assert len(sends.times) == 1
    hold.close()


def test_a_steady_loops_takes_do_not_wake_the_holds_thread() -> None:
    # The thread paces itself by the time between takes: a take that holds sets the wake-up
    # event only when the thread waits to be woken (the first take, or after a pause).
    sends = Sends()
    hold = CreditHold(sends.lock, sends)
    woken = []
    wake_set = hold._wake.set
    hold._wake.set = lambda: (woken.append(time.monotonic()), wake_set())  # type: ignore[method-assign]
    start = time.monotonic()
    takes = []
    for k in range(10):
        with sends.lock:
            takes.append(time.monotonic())
            held = hold.holds(takes[-1] - start, in_hand=SLACK)
        assert held == (k > 0)  # the first: no time between takes yet
        time.sleep(STEP)  # the training step between two takes (what the hold paces by)
    assert sends.sent.wait(10)
    hold.close()
    assert len(woken) <= 3, woken  # the first hold's, and at most two late takes'
    # Each held take's credits went out after it, before the next take's (or within a step).
    assert len(sends.times) >= 6
    for sent in sends.times:
        before = max(t for t in takes if t <= sent)
        assert sent - before < 2 * STEP


def test_nothing_is_sent_after_close() -> None:
    sends = Sends()
    hold = CreditHold(sends.lock, sends)
    hold.holds(0.0, in_hand=SLACK)
    with sends.lock:
        assert hold.holds(STEP, in_hand=SLACK)
        hold.close()
    thread = hold._thread
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive() and not sends.times
    assert not hold.holds(2 * STEP, in_hand=SLACK)  # closed: the caller sends, if anyone


class Stream:
    """A stream that records the credits it was sent (its server never answers)."""

    def __init__(self, channel: Any, address: str, spec: StreamSpec, on_batch: Any,
                 on_end: Any) -> None:
        self.address, self.bytes_received, self.capacity = address, 0, None
        self.credits: list[int] = []
        self.credited = threading.Event()  # set by every credit() call
        self.on_batch, self._on_end = on_batch, on_end

    def credit(self, indices: Any) -> None:
        self.credits.extend(indices)
        self.credited.set()

    def report(self, *args: Any) -> None:
        pass

    def close(self, wait: bool = True) -> None:
        self._on_end(self, None)


class Channel:
    def close(self) -> None:
        pass


def test_a_scheduler_holding_credits_sends_a_takes_from_the_holds_thread() -> None:
    opened: list[Stream] = []

    def factory(*args: Any) -> Stream:
        opened.append(Stream(*args))
        return opened[-1]

    now = [1000.0]
    servers = ServerSet(["a:1"], channel=lambda address, options: Channel())
    spec = StreamSpec(pb.Coordinates(dataset="toy", batch_size=2, world_size=1),
                      allocate=None, finish=None)  # type: ignore[arg-type]
    sched = Scheduler(servers, spec, total=20, start=0, window=4, timeout=30.0,
                      hold_credits=True, stream_factory=factory, clock=lambda: now[0])
    try:
        stream = opened[-1]
        assert stream.credits == [0, 1, 2, 3]
        for k in range(4):
            stream.on_batch(stream, k, f"batch {k}")
        sched.take(0)  # the first take: sent at once
        assert stream.credits == [0, 1, 2, 3, 4]
        now[0] += STEP
        stream.credited.clear()
        sched.take(1)  # batches 2 and 3 in hand: held
        assert stream.credits == [0, 1, 2, 3, 4]
        assert stream.credited.wait(10)  # the hold's thread sends it
        assert stream.credits == [0, 1, 2, 3, 4, 5]
    finally:
        sched.close()
        servers.close()
