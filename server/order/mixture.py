"""Weighted mixtures: which component, and which of its samples, fill each position.

A mixture's positions are numbered globally, across its epochs: position p of epoch e is
g = e * samples_per_epoch + p. The weights are a piecewise-constant function of g (a
`schedule`, each phase from a `from_sample` on). Inside a phase, positions are dealt to the
components by a binary tree of two-way splits, each one exact in closed form:

    a node with left weight L of its total S (integers) and offset phi in [0, S) sends its
    t-th position (t = 0, 1, ...) left when floor(((t+1)L + phi) / S) > floor((tL + phi) / S);
    the left child's own count before it is floor((tL + phi) / S), the right's t minus that.

So both the component of a position and its rank among that component's positions are a few
integer operations per tree level (no table, nothing cached but small per-seed constants),
and over any t positions each child's count is within one of t*L/S: a leaf at depth d is
within d samples of its share over any prefix, 2d over any window.

The split's positions are handed out in pieces (PIECE positions, cut at the epochs' and the
phases' bounds), permuted within each piece, each component's draws in position order
(`MixtureOrdering.draws`): ranks, which take every world_size-th position, would otherwise
read one phase of the splits' regular pattern. Weights are quantized to
integers out of UNITS (2**20) so that the arithmetic is exact (int64) and the same on every
server; phi comes from (seed, phase, node) under shuffle, else it is S // 2.

The k-th position given to component c, counted from g = 0, reads the component's draw k:
its epoch k // N_c and position k % N_c of that epoch's order, the component's own `Ordering`
(its own shuffle by (seed, component epoch), global or block). So a component is read without
replacement through its own epochs, and a small one that wraps goes on to its next epoch.

Index space. What a worker is handed for each position is one int64 that says which sample to
read and under which key: `component_epoch * period + offset_c + i`, where `period` is the sum
of the components' lengths, `offset_c` the sum of those before c in `components:`, and i the
component's own index. That number is the batch's `sample_index`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .sampling import ORDER_LEGACY, ORDERS, CoordinateError, Ordering

UNITS = 1 << 20  # a phase's weights, as integers summing to this
# Positions are dealt to components in pieces of this many, permuted within each
# (MixtureOrdering._scramble): every rank's batches carry the shares, not one phase of the
# splits' pattern, and any window of a few pieces still holds them closely.
PIECE = 256
# Positions g are below this, so that (g + 1) * L + phi < 2**63 with L, phi <= UNITS.
MAX_POSITION = 1 << 42


def quantize(weights: Sequence[float]) -> tuple[int, ...]:
    """`weights` as integers summing to UNITS (largest remainder); every positive weight gets
    at least one unit, so a component named with a weight is never silently left out."""
    total = float(sum(weights))
    if not total > 0:
        raise ValueError("weights must not all be 0")
    exact = [w / total * UNITS for w in weights]
    units = [int(x) if w == 0 else max(int(x), 1) for w, x in zip(weights, exact, strict=True)]
    # The remaining units go to the largest remainders; units taken by the minimum of 1 come
    # back from the largest weights.
    order = sorted(range(len(units)), key=lambda c: (-(exact[c] - int(exact[c])), c))
    short = UNITS - sum(units)
    i = 0
    while short > 0:
        c = order[i % len(order)]
        if weights[c] > 0:
            units[c] += 1
            short -= 1
        i += 1
    for c in sorted(range(len(units)), key=lambda c: -units[c]):
        while short < 0 and units[c] > 1:
            units[c] -= 1
            short += 1
    return tuple(units)


def locate(flat: Any, offsets: np.ndarray, period: int) -> tuple[Any, Any, Any]:
    """(component, component epoch, component index) of index-space values (an array, or
    one numpy integer)."""
    epoch, rest = np.divmod(flat, period)
    comp = np.searchsorted(offsets, rest, side="right") - 1
    return comp, epoch, rest - offsets[comp]


@dataclass(frozen=True)
class Phase:
    """From global position `start` on (until the next phase), these integer weights."""

    start: int
    units: tuple[int, ...]


class _Tree:
    """One phase's splits over its components of non-zero weight, balanced, in config order.

    Node ids: the root is 1, node n's children 2n and 2n + 1 (for the per-node phi)."""

    def __init__(self, units: tuple[int, ...]) -> None:
        self.units = units
        self.active = [c for c, u in enumerate(units) if u > 0]

    def assign(self, t: np.ndarray, phis: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """(component, rank among that component's positions) of each phase position t."""
        comp = np.empty(len(t), dtype=np.int64)
        rank = np.empty(len(t), dtype=np.int64)
        self._walk(self.active, 1, t, np.arange(len(t)), phis, comp, rank)
        return comp, rank

    def _walk(self, comps: list[int], node: int, t: np.ndarray, where: np.ndarray,
              phis: dict[int, int], comp: np.ndarray, rank: np.ndarray) -> None:
        if len(comps) == 1:
            comp[where], rank[where] = comps[0], t
            return
        left, right, big_l, big_s = self._split(comps)
        phi = phis[node]
        before = (t * big_l + phi) // big_s
        goes = ((t + 1) * big_l + phi) // big_s > before
        self._walk(left, 2 * node, before[goes], where[goes], phis, comp, rank)
        self._walk(right, 2 * node + 1, (t - before)[~goes], where[~goes], phis, comp, rank)

    def counts(self, t: int, phis: dict[int, int]) -> list[int]:
        """How many of the phase's first t positions each component gets."""
        out = [0] * len(self.units)
        todo = [(self.active, 1, t)]
        while todo:
            comps, node, n = todo.pop()
            if len(comps) == 1:
                out[comps[0]] = n
                continue
            left, right, big_l, big_s = self._split(comps)
            before = (n * big_l + phis[node]) // big_s
            todo += [(left, 2 * node, before), (right, 2 * node + 1, n - before)]
        return out

    def nodes(self) -> list[tuple[int, int]]:
        """(node id, its total S) of every split."""
        found, todo = [], [(self.active, 1)]
        while todo:
            comps, node = todo.pop()
            if len(comps) > 1:
                left, right, _, big_s = self._split(comps)
                found.append((node, big_s))
                todo += [(left, 2 * node), (right, 2 * node + 1)]
        return found

    def _split(self, comps: list[int]) -> tuple[list[int], list[int], int, int]:
        half = len(comps) // 2
        left, right = comps[:half], comps[half:]
        big_l = sum(self.units[c] for c in left)
        return left, right, big_l, big_l + sum(self.units[c] for c in right)


class MixtureOrdering:
    """A mixture's positions -> the index space above: what `batch_samples` maps positions
    through, like an `Ordering` (`num_samples` positions an epoch; `indices`, `epoch`).
    Picklable (it travels from worker 0 to the front end); any thread."""

    def __init__(self, names: Sequence[str], components: Sequence[Ordering],
                 phases: Sequence[Phase], samples_per_epoch: int) -> None:
        self.names = tuple(names)
        self.components = tuple(components)
        self.phases = tuple(phases)
        self.trees = tuple(_Tree(p.units) for p in phases)
        self.num_samples = samples_per_epoch
        self.sizes = np.array([o.num_samples for o in components], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.period = int(self.sizes.sum())
        self._constants: dict[tuple[int, bool], tuple[list[dict[int, int]], np.ndarray]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_constants", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _constants={}, _lock=threading.Lock())

    def indices(self, positions: np.ndarray, seed: int, epoch: int, shuffle: bool,
                order: int = ORDER_LEGACY) -> np.ndarray:
        """The index-space values of an epoch's `positions` (int64, a new array): computed
        for these positions alone under an index order (each component's draws through its
        own keyed order); under the legacy order sliced from the whole epoch's, kept in
        ORDERS, where the epoch fits that cache."""
        if order == ORDER_LEGACY and self.num_samples * 8 <= ORDERS.max_bytes:
            return self.epoch(seed, epoch, shuffle)[positions]
        return self._compute(np.asarray(positions, dtype=np.int64), seed, epoch, shuffle, order)

    def _compute(self, positions: np.ndarray, seed: int, epoch: int, shuffle: bool,
                 order: int = ORDER_LEGACY) -> np.ndarray:
        if (epoch + 1) * self.num_samples >= MAX_POSITION:
            raise CoordinateError("epoch", f"{epoch} is beyond what a mixture of "
                                           f"{self.num_samples} samples an epoch can count")
        g = epoch * self.num_samples + positions
        comp, draw = self.draws(g, seed, shuffle)
        out = np.empty(len(g), dtype=np.int64)
        for c in np.unique(comp).tolist():
            mine = comp == c
            own_epoch, pos = np.divmod(draw[mine], self.sizes[c])
            local = np.empty(len(pos), dtype=np.int64)
            for e in np.unique(own_epoch).tolist():
                same = own_epoch == e
                local[same] = self.components[c].indices(pos[same], seed, e, shuffle, order)
            out[mine] = own_epoch * self.period + self.offsets[c] + local
        return out

    def draws(self, g: np.ndarray, seed: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
        """(component, that component's draw number counted from g = 0) of global positions.

        Positions are dealt in pieces: a piece is a block of PIECE positions (in g) cut by
        the epochs' and the phases' bounds. A piece's positions take the components of the
        splits' positions over the same range in a permuted order, and each component's
        draws in position order. So what a piece, a phase or an epoch holds of each component
        is what the splits give it (the shares over windows a few pieces long hold closely),
        draws never go back (a component never repeats a sample before all of it is used),
        and rank r's positions r, r + world_size, ... do not read one phase of the splits'
        regular pattern: with weights 0.5/0.5 over 2 ranks, rank 0 would otherwise get one
        component only."""
        phis, bases = self._per_seed(seed, shuffle)
        starts = np.array([p.start for p in self.phases], dtype=np.int64)
        nxt = np.append(starts[1:], MAX_POSITION)
        n = self.num_samples
        phase = np.searchsorted(starts, g, side="right") - 1
        block = g // PIECE * PIECE
        lo = np.maximum(np.maximum(block, starts[phase]), g // n * n)
        hi = np.minimum(np.minimum(block + PIECE, nxt[phase]), (g // n + 1) * n)
        # Every piece the positions touch, whole: piece k holds [pieces[k], pieces[k] + size).
        pieces, first, where = np.unique(lo, return_index=True, return_inverse=True)
        sizes, phases = hi[first] - pieces, phase[first]
        ends = np.cumsum(sizes)
        piece_of = np.repeat(np.arange(len(pieces)), sizes)
        t = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int64)  # splits' positions
        before = np.empty((len(pieces), len(self.names)), dtype=np.int64)
        for k, (start, size, j) in enumerate(zip(pieces.tolist(), sizes.tolist(),
                                                 phases.tolist(), strict=True)):
            t0 = start - int(starts[j])
            rng = np.random.default_rng([seed if shuffle else 0, start, 0x6D6978])
            t[int(ends[k]) - size:int(ends[k])] = t0 + rng.permutation(size)
            before[k] = bases[j] + np.asarray(self.trees[j].counts(t0, phis[j]))
        c_all = np.empty(len(t), dtype=np.int64)
        for j in np.unique(phases).tolist():
            mine = phases[piece_of] == j
            c_all[mine], _ = self.trees[j].assign(t[mine], phis[j])
        # Each position's rank among its piece's positions of its component, in position order.
        key = piece_of * len(self.names) + c_all
        order = np.argsort(key, kind="stable")
        ranked = np.arange(len(key)) - np.searchsorted(key[order], key[order], side="left")
        rank = np.empty(len(key), dtype=np.int64)
        rank[order] = ranked
        d_all = before[piece_of, c_all] + rank
        at = ends[where] - sizes[where] + (g - lo)
        return c_all[at], d_all[at]

    def epoch(self, seed: int, epoch: int, shuffle: bool, order: int = ORDER_LEGACY
              ) -> np.ndarray:
        """The whole epoch's index-space values (read-only): from ORDERS under the legacy
        order; computed for the caller under an index order (tests, tools: O(n))."""
        if order != ORDER_LEGACY:
            whole = self._compute(np.arange(self.num_samples, dtype=np.int64), seed, epoch,
                                  shuffle, order)
            whole.flags.writeable = False
            return whole

        def compute() -> np.ndarray:
            order = self._compute(np.arange(self.num_samples, dtype=np.int64), seed, epoch,
                                  shuffle)
            order.flags.writeable = False
            return order
        return ORDERS.get((self, seed, epoch, shuffle), compute)

    def counts(self, flat: np.ndarray) -> np.ndarray:
        """Samples of each component among index-space values (for the metrics)."""
        comp, _, _ = locate(np.asarray(flat, dtype=np.int64), self.offsets, self.period)
        return np.bincount(comp, minlength=len(self.names))

    def _per_seed(self, seed: int, shuffle: bool) -> tuple[list[dict[int, int]], np.ndarray]:
        """Each phase's split offsets phi, and each component's draws before each phase."""
        key = (seed, shuffle)
        with self._lock:
            found = self._constants.get(key)
        if found is not None:
            return found
        phis = []
        for j, tree in enumerate(self.trees):
            phis.append({node: int(np.random.default_rng([seed, j, node]).integers(total))
                         if shuffle else total // 2 for node, total in tree.nodes()})
        bases = np.zeros((len(self.phases), len(self.names)), dtype=np.int64)
        for j in range(1, len(self.phases)):
            length = self.phases[j].start - self.phases[j - 1].start
            bases[j] = bases[j - 1] + self.trees[j - 1].counts(length, phis[j - 1])
        with self._lock:
            if len(self._constants) >= 64:  # many seeds: start over, they are cheap
                self._constants.clear()
            self._constants[key] = (phis, bases)
        return phis, bases
