"""Token budgets: which samples make batch k when batches are cut by tokens, not by count.

Under `batch_tokens = B` a rank's batch holds at most B real tokens (the sum of its samples'
lengths; padding is not counted, so a packed batch is at most B tokens long and a padded one
[n, longest] with n * mean length <= B). The plan of an epoch is a pure function of the
coordinates (dataset, seed, epoch, shuffle, world_size, batch_tokens, token_cost, start) and
the dataset's sample lengths, computed once and cached (`PLANS`, bounded in bytes like
_sampling.ORDERS), the same on every server. It is made in two steps:

1. Cut the epoch's positions (from `start`, the positions an earlier run consumed) into global
   steps. A step is a contiguous run of positions [a, b): it begins where the previous one
   ended, so "consumed after step s" is always a prefix of the epoch's order, which is what an
   elastic resume hands on (`cuts[s]`). b starts at the largest end whose run holds at most
   world_size * B tokens.
2. Split the run across the ranks: first by length (the run's samples sorted by length and
   cut into world_size runs of about equal cost, so each rank's samples have similar lengths
   and a padded batch wastes little); where that is not balanced, samples by cost, largest
   first, each to the rank with the least cost so far among those its tokens still fit in
   (LPT), then moves and swaps between the most and the least loaded ranks while they narrow
   the gap. The step is taken when every
   rank has a sample and every rank's cost is within BALANCE (5%) of the largest:
   max - min <= 0.05 * max. Otherwise b shrinks by one and the split is tried again (at most
   MAX_TRIES times; then the best split found is taken and counted in `unbalanced`, which the
   server logs: with samples much shorter than B this does not happen).

Cost is "tokens" (a sample's length) or "squares" (its length squared: attention's work);
either way the budget B counts tokens. A sample longer than B is refused when the coordinates
arrive (CoordinateError naming it), never truncated. The epoch's tail: positions left when
fewer than world_size remain are dropped (at most world_size - 1 samples; `dropped`). Every
other position is in exactly one rank's batch of exactly one step; every rank has the same
number of steps (`steps`, which is len(loader)).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .sampling import CoordinateError, Coordinates, OrderCache, Ordering, check_batch_index

log = logging.getLogger("stoker.server")

COSTS = ("tokens", "squares")
BALANCE = 0.05  # every rank's cost within this share of the step's largest
MAX_TRIES = 32  # run ends tried per step before the best split found is taken
IMPROVE_ROUNDS = 64  # moves and swaps tried per split


@dataclass(frozen=True)
class TokenPlan:
    """One epoch's steps under a token budget. Step k covers positions [cuts[k], cuts[k+1]);
    rank r's batch of step k is members[offsets[k * W + r] : offsets[k * W + r + 1]]
    (positions of the epoch's order)."""

    world_size: int
    cuts: np.ndarray  # int64 [steps + 1]
    members: np.ndarray  # int64, positions grouped by step then rank
    offsets: np.ndarray  # int64 [steps * world_size + 1]
    imbalance: np.ndarray  # float64 [steps]: (max - min) / max cost across ranks
    unbalanced: int  # steps over BALANCE (see the module docstring)
    dropped: int  # positions of the tail that no step holds

    @property
    def steps(self) -> int:
        return len(self.cuts) - 1

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.cuts, self.members, self.offsets, self.imbalance))

    @classmethod
    def of(cls, world_size: int, cuts: list[int], members: list[np.ndarray],
           offsets: list[int], gaps: list[float], unbalanced: int, dropped: int) -> TokenPlan:
        """A plan from the lists a planner built (cuts and members already positions of the
        epoch), its arrays read-only."""
        plan = cls(world_size, np.asarray(cuts, dtype=np.int64),
                   np.concatenate(members) if members else np.zeros(0, np.int64),
                   np.asarray(offsets, dtype=np.int64), np.asarray(gaps, np.float64),
                   unbalanced, dropped)
        for arr in (plan.cuts, plan.members, plan.offsets, plan.imbalance):
            arr.flags.writeable = False
        return plan

    def positions(self, step: int, rank: int) -> np.ndarray:
        k = step * self.world_size + rank
        return self.members[self.offsets[k] : self.offsets[k + 1]]


# The process's token plans, all datasets (a plan holds 8 bytes a sample, plus a little).
PLANS: OrderCache[TokenPlan] = OrderCache(256 << 20)


def check(lengths: np.ndarray | None, c: Coordinates) -> None:
    """Raise CoordinateError unless `c`'s token budget can be served from a dataset whose
    samples have these lengths (None: the dataset does not know them)."""
    if c.token_cost not in COSTS:
        raise CoordinateError("token_cost", f"must be one of {', '.join(COSTS)}, got "
                                            f"{c.token_cost!r}")
    if lengths is None:
        raise CoordinateError(
            "batch_tokens", f"dataset {c.dataset!r} does not know its samples' lengths: token "
                            "budgets need format jsonl or parquet with length_column set (a "
                            "mixture: every component so; see docs/configuration.md); use "
                            "batch_size")
    if len(lengths) and int(lengths.max()) > c.batch_tokens:
        i = int(np.argmax(lengths))
        raise CoordinateError(
            "batch_tokens", f"sample {i} of dataset {c.dataset!r} has {int(lengths[i])} tokens, "
                            f"more than batch_tokens={c.batch_tokens}: raise batch_tokens to at "
                            f"least the longest sample ({int(lengths.max())}), or cut long "
                            "samples in the data")


def plan(ordering: Ordering, lengths: np.ndarray, c: Coordinates) -> TokenPlan:
    """The epoch's plan for `c` (checked), from PLANS. `lengths`: the dataset's, by index
    (the ordering belongs to that dataset, so the ordering names it in the cache's key)."""
    key = _key(ordering, c)

    def make() -> TokenPlan:
        made = _make(ordering, lengths, c, c.start)
        STEPS.put(key, made.steps)
        return made

    return PLANS.get(key, make)


def batches_per_epoch(ordering: Ordering, lengths: np.ndarray, c: Coordinates) -> int:
    """The steps of `c`'s epoch: from STEPS once its plan was made, even if PLANS has let the
    plan go (seek walks epochs by their steps: server/order/epochs.py locate)."""
    found = STEPS.get(_key(ordering, c))
    return found if found is not None else plan(ordering, lengths, c).steps


def _key(ordering: Ordering, c: Coordinates) -> tuple:
    return ("tokens", ordering, c.seed, c.epoch, c.shuffle, c.world_size, c.batch_tokens,
            c.token_cost, getattr(c, "start", 0), c.order)


class StepCounts:
    """Each plan's steps by its key (an int each, at most `most`, the oldest out first).
    Any thread."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._items: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> int | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: tuple, steps: int) -> None:
        with self._lock:
            self._items[key] = steps
            while len(self._items) > self.most:
                self._items.popitem(last=False)


STEPS = StepCounts(1 << 20)  # about 100 MB at most, far less in practice

# Per family of plans (`_key` but epoch and start): the steps before each epoch, as far as
# made (a seek to a far step walks every epoch before it once; later ones bisect).
_RUNNING: dict[tuple, list[int]] = {}
_RUNNING_LOCK = threading.Lock()


def locate_whole(ordering: Ordering, lengths: np.ndarray, c: Coordinates, steps: int
                 ) -> tuple[int, int]:
    """(epoch, batch index) `steps` steps after the beginning of `c`'s epoch (start 0), each
    epoch its plan's steps. The plans of the epochs up to it are made once (their steps kept:
    STEPS), and their running sums from epoch 0 (_RUNNING), which a later seek bisects; from
    an epoch the sums do not reach yet (where an elastic change began a world size), a walk
    over STEPS from there, not from 0. CoordinateError for an epoch without a step."""
    def count(epoch: int) -> int:
        n = batches_per_epoch(ordering, lengths, dataclasses.replace(c, epoch=epoch, start=0))
        if n <= 0:
            raise CoordinateError("locate.step", "these coordinates give no batch per epoch")
        return n

    key = _key(ordering, c)  # epoch and start left out: [3] and [-2]
    family = key[:3] + key[4:-2] + key[-1:]
    with _RUNNING_LOCK:  # one walk at a time: a second seek waits for the first's epochs
        if len(_RUNNING) >= 256 and family not in _RUNNING:
            _RUNNING.clear()
        before = _RUNNING.setdefault(family, [0])
        if len(before) > c.epoch:  # the sums reach this epoch: extend them, bisect
            target = before[c.epoch] + steps
            while before[-1] <= target:
                before.append(before[-1] + count(len(before) - 1))
            epoch = bisect.bisect_right(before, target) - 1
            return epoch, target - before[epoch]
    epoch = c.epoch  # from an epoch after an elastic change: not the epochs before it
    while steps >= (n := count(epoch)):
        steps -= n
        epoch += 1
    return epoch, steps


def batch_samples(ordering: Ordering, lengths: np.ndarray, c: Coordinates,
                  batch_index: int) -> np.ndarray:
    """Dataset indices of rank c.rank's batch `batch_index` (a new array)."""
    p = plan(ordering, lengths, c)
    check_batch_index(batch_index, p.steps)
    positions = p.positions(batch_index, c.rank)
    return np.array(ordering.indices(positions, c.seed, c.epoch, c.shuffle, c.order),
                    dtype=np.int64)


def _make(ordering: Ordering, lengths: np.ndarray, c: Coordinates, start: int) -> TokenPlan:
    order = ordering.indices(np.arange(start, ordering.num_samples, dtype=np.int64), c.seed,
                             c.epoch, c.shuffle, c.order)
    # A mixture's index space repeats its components' samples each period (its lengths')
    lens = np.asarray(lengths, dtype=np.int64)[order % len(lengths)]
    costs = lens if c.token_cost == "tokens" else lens * lens
    world, budget = c.world_size, c.batch_tokens
    ends = np.cumsum(lens)  # tokens in positions [0, i] of `lens`
    made = PlanSteps()
    a, n = 0, len(lens)
    while n - a >= world:
        before = int(ends[a - 1]) if a else 0
        b_max = int(np.searchsorted(ends, before + world * budget, side="right"))
        b_max = max(b_max, a + world)  # every sample fits B, so world of them fit world * B
        best = best_split(lens, costs, a, range(b_max, max(a + world, b_max - MAX_TRIES) - 1, -1),
                          world, budget)
        if best is None:  # cannot happen: one sample per rank always fits
            raise AssertionError(f"no split of positions {a}..{a + world}")
        a = made.add(best, a, start)
    p = made.plan(world, start, n - a)
    if made.unbalanced:
        log.warning("dataset %r epoch %d: %d of %d steps of batch_tokens=%d over %d ranks could "
                    "not be balanced within %d%% (samples long against batch_tokens?)",
                    c.dataset, c.epoch, made.unbalanced, p.steps, budget, world, 100 * BALANCE)
    return p


class PlanSteps:
    """A plan's steps as they are chosen, in order; `plan` makes the TokenPlan. Positions are
    relative to the plan's `base` (its first position in the epoch)."""

    def __init__(self) -> None:
        self.cuts = [0]
        self.members: list[np.ndarray] = []
        self.offsets = [0]
        self.gaps: list[float] = []
        self.unbalanced = 0  # steps over BALANCE

    def add(self, split: tuple[float, int, list[list[int]]], a: int, base: int) -> int:
        """The step of `split` (best_split's imbalance, end and groups) from position `a`;
        its end."""
        gap, b, groups = split
        self.unbalanced += gap > BALANCE
        for g in groups:
            self.members.append(np.sort(np.asarray(g, dtype=np.int64)) + a + base)
            self.offsets.append(self.offsets[-1] + len(g))
        self.gaps.append(gap)
        self.cuts.append(b)
        return b

    def plan(self, world: int, base: int, dropped: int) -> TokenPlan:
        return TokenPlan.of(world, [cut + base for cut in self.cuts], self.members,
                            self.offsets, self.gaps, self.unbalanced, dropped)


def best_split(lens: np.ndarray, costs: np.ndarray, a: int, ends: Iterable[int], world: int,
               budget: int) -> tuple[float, int, list[list[int]]] | None:
    """(imbalance, end b, groups) of the first of `ends` whose run [a, b) splits across the
    ranks within the budget and BALANCE, else of the most balanced split found; None when
    no end's run fits."""
    best: tuple[float, int, list[list[int]]] | None = None
    for b in ends:
        groups = split_step(lens[a:b], costs[a:b], world, budget)
        if groups is None:
            continue
        gap = imbalance(costs[a:b], groups)
        if best is None or gap < best[0]:
            best = (gap, b, groups)
        if gap <= BALANCE:
            break
    return best


def imbalance(costs: np.ndarray, groups: list[list[int]]) -> float:
    loads = [int(costs[g].sum()) for g in groups]
    top = max(loads)
    return (top - min(loads)) / top if top else 0.0


def split_step(lens: np.ndarray, costs: np.ndarray, world: int, budget: int
           ) -> list[list[int]] | None:
    """Items 0..len-1 over `world` ranks, each rank's tokens at most `budget`: by length
    (`_split_by_length`) where that is balanced, else as evenly as LPT and a few improvements
    make them; None if an item fits no rank or a rank is left empty."""
    groups = _split_by_length(lens, costs, world, budget)
    if groups is not None and imbalance(costs, groups) <= BALANCE:
        return groups
    return _split_even(lens, costs, world, budget)


def _split_by_length(lens: np.ndarray, costs: np.ndarray, world: int, budget: int
                     ) -> list[list[int]] | None:
    """The items sorted by length, cut into `world` runs of about equal cost: each rank gets
    samples of similar lengths, so a padded batch wastes little (padding goes to the longest
    of the rank's batch). None if a run is empty or over the budget."""
    by_len = np.argsort(lens, kind="stable")
    total = np.cumsum(costs[by_len])
    # Cut k ends where the running cost is nearest k/world of the whole.
    targets = total[-1] * np.arange(1, world) / world
    right = np.searchsorted(total, targets)
    left = np.maximum(right - 1, 0)
    nearer = np.abs(total[left] - targets) <= np.abs(total[np.minimum(right, len(total) - 1)]
                                                     - targets)
    cuts = np.where(nearer, left, right) + 1
    bounds = [0, *cuts.tolist(), len(by_len)]
    groups = [by_len[a:b].tolist() for a, b in itertools.pairwise(bounds)]
    if any(not g or int(lens[g].sum()) > budget for g in groups):
        return None
    return groups


def _split_even(lens: np.ndarray, costs: np.ndarray, world: int, budget: int
                ) -> list[list[int]] | None:
    """LPT (largest cost first, to the least-loaded rank it fits), then moves and swaps
    between the most and the least loaded ranks while they narrow the gap."""
    load = [0] * world
    tokens = [0] * world
    groups: list[list[int]] = [[] for _ in range(world)]
    lens_l, costs_l = lens.tolist(), costs.tolist()
    # The least-loaded rank the item fits (the first such rank on a tie): the heap's least
    # (load, rank) that fits; those passed over go back.
    heap = [(0, r) for r in range(world)]
    for i in np.argsort(-costs, kind="stable").tolist():
        passed = []
        while heap and tokens[heap[0][1]] + lens_l[i] > budget:
            passed.append(heapq.heappop(heap))
        if not heap:
            return None
        best = heap[0][1]
        groups[best].append(i)
        load[best] += costs_l[i]
        tokens[best] += lens_l[i]
        heapq.heapreplace(heap, (load[best], best))
        for item in passed:
            heapq.heappush(heap, item)
    if any(not g for g in groups):
        return None
    for _ in range(IMPROVE_ROUNDS):
        hi = max(range(world), key=load.__getitem__)
        lo = min(range(world), key=load.__getitem__)
        gap = load[hi] - load[lo]
        if gap <= BALANCE * load[hi]:
            break
        # The move (i from hi to lo) or swap (i for j) whose shift of cost is nearest gap / 2:
        # the pair's gap narrows whenever 0 < shift < gap.
        pick: tuple[int, int | None] | None = None
        shift_best = None
        room = budget - tokens[lo]
        for i in groups[hi]:
            if len(groups[hi]) > 1 and lens_l[i] <= room and 0 < costs_l[i] < gap:
                s = costs_l[i]
                if shift_best is None or abs(2 * s - gap) < abs(2 * shift_best - gap):
                    pick, shift_best = (i, None), s
            for j in groups[lo]:
                s = costs_l[i] - costs_l[j]
                if (0 < s < gap and tokens[lo] + lens_l[i] - lens_l[j] <= budget
                        and (shift_best is None or abs(2 * s - gap) < abs(2 * shift_best - gap))):
                    pick, shift_best = (i, j), s
        if pick is None:
            break
        moved, swapped = pick
        for one, src, dst in ((moved, hi, lo), (swapped, lo, hi)):
            if one is None:
                continue
            groups[src].remove(one)
            groups[dst].append(one)
            load[src] -= costs_l[one]
            load[dst] += costs_l[one]
            tokens[src] -= lens_l[one]
            tokens[dst] += lens_l[one]
    return groups
