"""The index order's shuffle, held to what a uniform random permutation would give.

Each statistic is compared with its distribution under a uniform permutation (chi-square,
correlation's standard error), at thresholds a uniform permutation fails with probability
well under 1e-6, and each test also runs a deliberately weak bijection (one Feistel round, the
identity's rotation) through the same statistic to show it could fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from stoker.server.order import permute as feistel
from stoker.server.order.sampling import ORDER_INDEX, Coordinates, Ordering, batch_samples

pytestmark = pytest.mark.timeout(120)

# A uniform permutation passes each check with probability > 1 - 1e-6.
P_FLOOR = 1e-6


def order_of(n: int, seed: int, epoch: int, rounds: int = feistel.ROUNDS) -> np.ndarray:
    keys = feistel.keys_for(seed, epoch, 0x6F72646572, rounds=rounds)
    return feistel.permute(np.arange(n, dtype=np.int64), n, keys)


def positions_over_seeds(n: int, seeds: int, rounds: int = feistel.ROUNDS) -> np.ndarray:
    """[seeds, n]: where each sample sits in each seed's epoch-0 order."""
    out = np.empty((seeds, n), dtype=np.int64)
    for s in range(seeds):
        order = order_of(n, s, 0, rounds)
        out[s, order] = np.arange(n)
    return out


def uniformity_p(positions: np.ndarray, n: int, bins: int) -> float:
    """Chi-square p-value that each sample's position is uniform over [0, n), pooled over
    samples: counts of (sample, position bin) against seeds / bins each."""
    seeds, _ = positions.shape
    counts = np.zeros((n, bins))
    np.add.at(counts, (np.tile(np.arange(n), seeds), (positions * bins // n).ravel()), 1)
    return float(stats.chisquare(counts.ravel(), np.full(n * bins, seeds / bins)).pvalue)


@pytest.mark.parametrize("n", [10, 1000, 4099])
def test_a_bijection_for_sizes_that_walk_cycles(n: int) -> None:
    for seed in range(5):
        assert np.array_equal(np.sort(order_of(n, seed, 3)), np.arange(n))


def test_large_domains_evaluated_per_index() -> None:
    n = 2**40 - 3
    keys = feistel.keys_for(1, 2, 3)
    x = np.array([0, 1, 2, n - 1, n // 2], dtype=np.int64)
    y = feistel.permute(x, n, keys)
    assert ((0 <= y) & (y < n)).all() and len(set(y.tolist())) == len(y)
    assert np.array_equal(feistel.permute(x[::-1], n, keys), y[::-1])  # per index


def test_each_samples_position_is_uniform_over_seeds() -> None:
    n, seeds, bins = 200, 400, 8
    assert uniformity_p(positions_over_seeds(n, seeds), n, bins) > P_FLOOR
    weak = positions_over_seeds(n, seeds, rounds=1)  # one round: the high half is fixed
    assert uniformity_p(weak, n, bins) < P_FLOOR


def correlation_z(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's r of two position vectors in units of its standard error under
    independence (about 1 / sqrt(n))."""
    r = float(np.corrcoef(a, b)[0, 1])
    return abs(r) * np.sqrt(len(a) - 1)


def test_no_correlation_between_consecutive_epochs_or_seeds() -> None:
    n = 1 << 16  # 16 bits: no cycle walking, so one round's structure shows whole
    z_limit = 5.0  # |z| > 5: p < 6e-7 under independence

    def where(order: np.ndarray) -> np.ndarray:
        pos = np.empty(n)
        pos[order] = np.arange(n)
        return pos

    pos0, pos1 = where(order_of(n, 7, 0)), where(order_of(n, 7, 1))
    assert correlation_z(pos0, pos1) < z_limit  # a sample's position in epoch 0 and 1
    assert correlation_z(pos0 % 256, pos1 % 256) < z_limit
    pos_s = where(order_of(n, 8, 0))
    assert correlation_z(pos0, pos_s) < z_limit  # ... under two seeds
    e0 = order_of(n, 7, 0)
    assert correlation_z(e0[:-1], e0[1:]) < z_limit  # consecutive positions' samples
    assert correlation_z(np.arange(n), e0) < z_limit  # position against sample index
    # One round: a position's low half is its sample's high half, whatever the epoch.
    weak0, weak1 = where(order_of(n, 7, 0, rounds=1)), where(order_of(n, 7, 1, rounds=1))
    assert correlation_z(weak0 % 256, weak1 % 256) > z_limit


def test_ranks_shares_of_block_structured_data_look_uniform() -> None:
    """Data laid out in blocks (8 sources of 512 samples each, one after another): each of
    64 ranks' first 16 samples should hold the sources in proportion, pooled over 50 seeds,
    as under a uniform permutation; under the identity, or one round, they do not."""
    n, sources, world, per_rank, seeds = 4096, 8, 64, 16, 50

    def table(order: np.ndarray) -> np.ndarray:
        counts = np.zeros((world, sources))
        for r in range(world):
            mine = order[r : world * per_rank : world]
            counts[r] = np.bincount(mine // (n // sources), minlength=sources)
        return counts

    def p_value(orders: list[np.ndarray]) -> float:
        total = sum(table(o) for o in orders)
        expected = len(orders) * per_rank / sources
        return float(stats.chisquare(total.ravel(), np.full(total.size, expected)).pvalue)

    assert p_value([order_of(n, s, 0) for s in range(seeds)]) > P_FLOOR
    assert p_value([order_of(n, s, 0, rounds=1) for s in range(seeds)]) < P_FLOOR
    assert p_value([np.arange(n)] * seeds) < P_FLOOR  # unshuffled: rank r reads one source


def test_batches_through_the_coordinates_cost_a_batch() -> None:
    """Batch k of a billion-sample epoch, any rank, any start: distinct, in range, the same
    on a second call, and no epoch order made (nothing kept by the ordering)."""
    n = 10**9
    ordering = Ordering(n)
    seen = []
    for rank, world, start in ((0, 8, 0), (7, 8, 0), (2, 3, 123_456_789)):
        c = Coordinates("big", 5, 4, True, rank, world, 256, True, start, order=ORDER_INDEX)
        b = batch_samples(ordering, c, 400_000)
        assert len(b) == 256 and ((0 <= b) & (b < n)).all()
        assert np.array_equal(b, batch_samples(ordering, c, 400_000))
        seen.append(b)
    assert len(np.unique(np.concatenate(seen[:2]))) == 512  # ranks 0 and 7: disjoint
