"""Token budgets under index orders: plans made for windows of positions, each alone.

token_batches.py plans a whole epoch at once (the legacy order's way: 2 us and 8 bytes a
sample, before the first batch). Here an epoch's positions from `start` are cut into windows
of `window` positions (the last one shorter), and window w gets a fixed number of steps,
S(size of w), computed from the dataset's length statistics alone:

    S(p) = ceil(p * (mean + Z * std / sqrt(p)) / (world_size * batch_tokens * fill))
    fill = FILL * (1 - mean / (2 * batch_tokens))   (a rank's batch ends ~half a sample short)

(mean and std of the samples' lengths, the largest over shards or mixture components: a
window is a sample of them), at most p // world_size. So an epoch has
(windows - 1) * S(window) + S(last window's size) steps, in closed form: its length, a seek
to any step and the window that holds it are arithmetic, and a batch costs one window's plan
(kept in token_batches.PLANS, by bytes).

A window's plan: its positions' lengths, cut into S contiguous runs, each ending near its
share of the tokens left (run ends tried around that target, up to MAX_TRIES, for the first
one whose split across the ranks fits the budget and is balanced within BALANCE), each run
split across the ranks as token_batches splits a step. Steps are contiguous runs of
positions, so "consumed after step s" is still a prefix of the order (what an elastic
resume hands on). A run that no end makes splittable (samples long against batch_tokens)
gives up its longest samples until it is:
they are `dropped`, counted and logged, like the epoch's tail (at most world_size - 1
positions of the last window). With samples short against the budget the slack Z * std leaves
makes this rare (none in 5 windows of 32,768 log-normal lengths up to the budget itself);
what it costs is fill: about fill / (1 + Z * cv / sqrt(window)) of world_size *
batch_tokens a step, 0.89-0.94 in those tests (the legacy whole-epoch plan fills steps up to
what balance allows).

Threading: pure functions over their arguments, plans cached in PLANS (any thread).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from dataclasses import dataclass

import numpy as np

from .sampling import Coordinates, Ordering, check_batch_index
from .token_batches import (
    BALANCE,
    MAX_TRIES,
    PLANS,
    PlanSteps,
    TokenPlan,
    best_split,
    imbalance,
    split_step,
)

log = logging.getLogger("stoker.server")

FILL = 0.97  # a step's expected tokens, of world_size * batch_tokens
Z = 4.0  # standard deviations of a window's mean length allowed for
WINDOW = 32768  # positions a window, at least
MIN_STEPS = 64  # ... and enough for this many steps of the mean length
MAX_WINDOW = 1 << 21


@dataclass(frozen=True)
class Shape:
    """How an epoch under `c` is cut: windows of `window` positions from `start`, `steps`
    steps each (the last window `last` positions, `last_steps` steps)."""

    start: int
    window: int
    steps: int
    windows: int
    last: int
    last_steps: int

    @property
    def total(self) -> int:
        return (self.windows - 1) * self.steps + self.last_steps if self.windows else 0

    def window_of(self, step: int) -> tuple[int, int]:
        """(window, step within it) of the epoch's step `step`."""
        w = min(step // self.steps, self.windows - 1) if self.steps else self.windows - 1
        return w, step - w * self.steps

    def bounds(self, w: int) -> tuple[int, int, int]:
        """(first position, positions, steps) of window w."""
        first = self.start + w * self.window
        if w == self.windows - 1:
            return first, self.last, self.last_steps
        return first, self.window, self.steps


_STATS: dict[tuple[int, int], tuple[float, float]] = {}
_STATS_LOCK = threading.Lock()


def _length_stats(ordering: Ordering, lengths: np.ndarray) -> tuple[float, float]:
    """(mean, std) of a window's lengths to plan for: the largest over the groups a window may
    draw from unevenly (a mixture's components, a block shuffle's shards), once per dataset."""
    key = (id(ordering), id(lengths))
    with _STATS_LOCK:
        found = _STATS.get(key)
    if found is not None:
        return found
    lens = np.asarray(lengths, dtype=np.float64)
    starts = getattr(ordering, "offsets", None)  # a mixture: its components
    if starts is None and getattr(ordering, "block", False):
        starts = ordering.shard_starts
    if starts is None or len(starts) <= 1:
        found = (float(lens.mean()) if len(lens) else 0.0, float(lens.std()) if len(lens) else 0.0)
    else:
        bounds = np.append(np.asarray(starts, dtype=np.int64), len(lens))
        groups = [lens[a:b] for a, b in itertools.pairwise(bounds) if b > a]
        found = (max(float(g.mean()) for g in groups), max(float(g.std()) for g in groups))
    with _STATS_LOCK:
        if len(_STATS) >= 256:
            _STATS.clear()
        _STATS[key] = found
    return found


def _steps_for(positions: int, mean: float, std: float, c: Coordinates) -> int:
    if positions < c.world_size:
        return 0
    high = mean + Z * std / math.sqrt(positions)
    # A rank's batch ends about half a sample short of the budget: room lost to packing.
    fill = FILL * (1 - mean / (2 * c.batch_tokens))
    need = math.ceil(positions * high / (c.world_size * c.batch_tokens * fill))
    return max(1, min(need, positions // c.world_size))


def shape(ordering: Ordering, lengths: np.ndarray, c: Coordinates) -> Shape:
    """The epoch's windows and steps under `c` (arithmetic on the length statistics)."""
    mean, std = _length_stats(ordering, lengths)
    rest = max(ordering.num_samples - c.start, 0)
    per_step = max(c.world_size * c.batch_tokens * FILL / max(mean, 1.0), 1.0)
    window = int(min(max(WINDOW, math.ceil(MIN_STEPS * per_step)), MAX_WINDOW))
    windows = -(-rest // window)
    if not windows:
        return Shape(c.start, window, 0, 0, 0, 0)
    last = rest - (windows - 1) * window
    return Shape(c.start, window, _steps_for(window, mean, std, c), windows, last,
                 _steps_for(last, mean, std, c))


def batches_per_epoch(ordering: Ordering, lengths: np.ndarray, c: Coordinates) -> int:
    return shape(ordering, lengths, c).total


def window_plan(ordering: Ordering, lengths: np.ndarray, c: Coordinates, w: int) -> TokenPlan:
    """Window w's plan (from PLANS): its cuts and members are positions of the epoch."""
    key = ("window", ordering, c.seed, c.epoch, c.shuffle, c.world_size, c.batch_tokens,
           c.token_cost, c.start, c.order, w)
    return PLANS.get(key, lambda: _make(ordering, lengths, c, w))


def batch_samples(ordering: Ordering, lengths: np.ndarray, c: Coordinates,
                  batch_index: int) -> np.ndarray:
    """Dataset indices of rank c.rank's batch `batch_index` (a new array)."""
    s = shape(ordering, lengths, c)
    check_batch_index(batch_index, s.total)
    w, k = s.window_of(batch_index)
    positions = window_plan(ordering, lengths, c, w).positions(k, c.rank)
    return np.array(ordering.indices(positions, c.seed, c.epoch, c.shuffle, c.order),
                    dtype=np.int64)


def consumed(ordering: Ordering, lengths: np.ndarray, c: Coordinates, steps: int) -> int:
    """Where step `steps` begins (all before it consumed): a position of the epoch."""
    s = shape(ordering, lengths, c)
    if steps >= s.total:
        return ordering.num_samples
    w, k = s.window_of(steps)
    return int(window_plan(ordering, lengths, c, w).cuts[k])


def _make(ordering: Ordering, lengths: np.ndarray, c: Coordinates, w: int) -> TokenPlan:
    s = shape(ordering, lengths, c)
    first, size, steps = s.bounds(w)
    index = ordering.indices(np.arange(first, first + size, dtype=np.int64), c.seed, c.epoch,
                             c.shuffle, c.order)
    # A mixture's index space repeats its components' samples each period (its lengths')
    lens = np.asarray(lengths, dtype=np.int64)[np.asarray(index) % len(lengths)]
    costs = lens if c.token_cost == "tokens" else lens * lens
    world, budget = c.world_size, c.batch_tokens
    ends = np.cumsum(lens)
    total = int(ends[-1]) if size else 0
    made = PlanSteps()
    dropped = 0
    for k in range(steps):
        a = made.cuts[-1]
        left = steps - k - 1  # runs after this one: each needs world positions
        lo, hi = a + world, size - left * world
        if k == steps - 1:
            lo = hi = size
        # This run's share of the tokens left (not of the window's: a run cut short by the
        # budget does not leave its surplus to pile up in the last one)
        done = int(ends[a - 1]) if a else 0
        share = done + (total - done) / (steps - k)
        target = int(np.searchsorted(ends, share, side="left")) + 1
        best = best_split(lens, costs, a, _around(min(max(target, lo), hi), lo, hi), world,
                          budget)
        if best is None:  # no end fits: the run's longest samples give way
            b = min(max(target, lo), hi)
            groups, lost = _fit(lens, costs, a, b, world, budget)
            dropped += lost
            best = (imbalance(costs[a:b], groups), b, groups)
        made.add(best, a, first)
    if not steps:
        dropped += size
    plan = made.plan(world, first, dropped)
    if made.unbalanced or (dropped and w != s.windows - 1):
        log.warning("dataset %r epoch %d window %d: %d of %d steps of batch_tokens=%d over %d "
                    "ranks not balanced within %d%%, %d samples left out (samples long "
                    "against batch_tokens?)", c.dataset, c.epoch, w, made.unbalanced, steps,
                    budget, world, 100 * BALANCE, dropped)
    return plan


def _around(target: int, lo: int, hi: int) -> list[int]:
    """Run ends to try: the target, then alternately before and after it, within [lo, hi]."""
    found = [target]
    for d in range(1, MAX_TRIES):
        found += [b for b in (target - d, target + d) if lo <= b <= hi]
        if len(found) >= MAX_TRIES:
            break
    return found


def _fit(lens: np.ndarray, costs: np.ndarray, a: int, b: int, world: int, budget: int
         ) -> tuple[list[list[int]], int]:
    """A split of run [a, b) without its longest samples, as few as make it fit; (groups,
    samples left out). One sample a rank always fits (each is at most the budget)."""
    order = np.argsort(-lens[a:b], kind="stable")
    for lost in range(1, b - a - world + 1):
        keep = np.sort(order[lost:])
        groups = split_step(lens[a:b][keep], costs[a:b][keep], world, budget)
        if groups is not None:
            return [keep[g].tolist() for g in groups], lost
    keep = np.sort(order[b - a - world:])
    return [[int(i)] for i in keep], b - a - world
