"""Token budgets under index orders, planned by windows (server/order/token_windows.py):
every position once but the tail, every rank within 5% and the budget, an epoch's length and
a far step by arithmetic, a window planned alone equal to the same window planned in turn,
and elastic prefixes exact. Plain functions over arrays: no server."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from stoker.server.order import token_windows as tw
from stoker.server.order.epochs import consumed, epoch_size, locate, samples_of
from stoker.server.order.sampling import ORDER_INDEX, Coordinates, Ordering

pytestmark = pytest.mark.timeout(120)


@dataclasses.dataclass
class Meta:
    num_samples: int
    ordering: Ordering
    lengths: np.ndarray


def meta(n: int, seed: int = 0, high: int = 400) -> Meta:
    lengths = np.random.default_rng(seed).lognormal(4.5, 0.8, n).astype(np.int64)
    return Meta(n, Ordering(n), np.clip(lengths, 1, high))


def coords(rank: int = 0, world: int = 4, budget: int = 2048, **kw) -> Coordinates:
    return Coordinates("docs", 3, kw.pop("epoch", 1), True, rank, world, 0, True,
                       batch_tokens=budget, **{"order": ORDER_INDEX, **kw})


def whole_epoch(m: Meta, c: Coordinates) -> list[list[np.ndarray]]:
    steps = epoch_size(m, c)[0]
    return [[samples_of(m, dataclasses.replace(c, rank=r), k) for r in range(c.world_size)]
            for k in range(steps)]


@pytest.mark.parametrize("cost", ["tokens", "squares"])
def test_every_sample_once_within_budget_and_balanced(cost: str) -> None:
    m = meta(50_000)
    c = coords(token_cost=cost)
    assert tw.shape(m.ordering, m.lengths, c).windows > 1  # several windows
    seen, gaps = [], []
    for step in whole_epoch(m, c):
        loads = []
        for batch in step:
            assert len(batch) and m.lengths[batch].sum() <= c.batch_tokens
            loads.append(int((m.lengths[batch] ** (1 if cost == "tokens" else 2)).sum()))
            seen.append(batch)
        gaps.append((max(loads) - min(loads)) / max(loads))
    every = np.concatenate(seen)
    assert len(np.unique(every)) == len(every)  # none twice
    assert m.num_samples - len(every) < c.world_size  # only the tail is left out
    assert np.mean(np.asarray(gaps) <= 0.05) >= 0.99, max(gaps)
    fill = m.lengths.sum() / (len(gaps) * c.world_size * c.batch_tokens)
    assert fill > 0.85  # what the windows' slack costs


def test_length_and_far_steps_are_arithmetic_and_a_window_planned_alone_is_the_same() -> None:
    m = meta(3_000_000)
    c = coords(world=8, budget=8192)
    t0 = time.perf_counter()
    steps = epoch_size(m, c)[0]
    far = steps - 3
    alone = samples_of(m, c, far)  # the last window, planned first and alone
    took = time.perf_counter() - t0
    assert took < 5.0  # one window's plan, not 3e6 samples' (about 6 s at 2 us each)
    tw.PLANS.resize(0)  # forget every plan: the same window planned again, in another order
    try:
        assert np.array_equal(samples_of(m, c, far), alone)
    finally:
        tw.PLANS.resize(256 << 20)
    epoch, start, batch = locate(m, c, 5 * steps + 17)
    assert (epoch, start, batch) == (5, 0, 17)


def test_an_elastic_prefix_is_exact() -> None:
    m = meta(40_000)
    c = coords(world=4)
    taken = whole_epoch(m, c)[:25]
    at = consumed(m, dataclasses.replace(c, rank=0), 25)
    used = np.concatenate([b for step in taken for b in step])
    order = m.ordering.indices(np.arange(at), c.seed, c.epoch, True, ORDER_INDEX)
    assert sorted(used.tolist()) == sorted(order.tolist())  # the prefix, whole
    rest = whole_epoch(m, dataclasses.replace(c, world_size=3, start=at))
    after = np.concatenate([b for step in rest for b in step])
    assert not set(after.tolist()) & set(used.tolist())
    assert m.num_samples - len(used) - len(after) < 3


def test_long_samples_are_dropped_counted_never_over_the_budget() -> None:
    """Samples as long as the budget: runs that no end makes splittable give up samples,
    counted in the plan; no rank's batch is ever over the budget."""
    lengths = np.full(2000, 1000, dtype=np.int64)
    lengths[::7] = 1024
    m = Meta(2000, Ordering(2000), lengths)
    c = coords(world=2, budget=1024)
    total = 0
    for step in whole_epoch(m, c):
        for batch in step:
            assert len(batch) == 1 and lengths[batch].sum() <= 1024
            total += 1
    plan = tw.window_plan(m.ordering, m.lengths, c, 0)
    assert total + plan.dropped == 2000


def test_the_legacy_order_keeps_its_whole_epoch_plan() -> None:
    """Runs resumed from before index orders: one plan for the epoch, every sample once but
    the tail, every step within the budget."""
    from stoker.server.order import token_batches
    from stoker.server.order.sampling import ORDER_LEGACY

    m = meta(3000)
    c = coords(order=ORDER_LEGACY)
    plan = token_batches.plan(m.ordering, m.lengths, c)
    seen = np.concatenate([samples_of(m, dataclasses.replace(c, rank=r), k)
                           for k in range(plan.steps) for r in range(c.world_size)])
    assert len(np.unique(seen)) == len(seen) and 3000 - len(seen) < c.world_size
    assert epoch_size(m, c)[0] == plan.steps
    legacy = np.random.default_rng([c.seed, c.epoch]).permutation(3000)
    assert sorted(seen.tolist()) == sorted(legacy[: plan.cuts[-1]].tolist())
