"""Keyed bijections of [0, n), evaluated per index: an epoch's order without the epoch.

`permute(x, n, keys)` is where position x of a shuffled epoch of n samples reads from. It is
a balanced Feistel network on the smallest even number of bits b with 2**b >= n, walked in
cycles until it lands below n:

    L, R = x >> h, x & (2**h - 1)           (h = b / 2)
    each round i:  L, R = R, L ^ F(R, k_i)   F = the high h bits of mix64(R ^ k_i)

Each round is a bijection of [0, 2**b) (it can be undone: L = R' ^ F(L', k_i)), so the
network is one; cycle walking (apply it again while the value is >= n) restricted to [0, n)
is then a bijection of [0, n) too, since following a cycle of a permutation from a value below
n reaches the next value below n on the same cycle. 2**b < 4n, so a walk takes fewer than 4
steps on average. With ROUNDS rounds of a well-mixed round function this is a pseudo-random
permutation (Luby-Rackoff: 4 rounds suffice for a strong one); the statistical tests
(tests/test_order_quality.py) check positions, epochs and seeds, and catch a single round.

Cost: O(len(x)) time and memory, nothing per n: a batch of a billion-sample epoch costs what
it costs for a thousand. Valid for n up to 2**62. The same values on every machine: uint64
arithmetic only, keys from numpy's SeedSequence (stable across numpy versions).

Threading: pure functions.
"""

from __future__ import annotations

import functools

import numpy as np

ROUNDS = 6
MAX_N = 1 << 62
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over a uint64 array (a new array): every output bit depends on
    every input bit."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def keys_for(*words: int, rounds: int = ROUNDS) -> np.ndarray:
    """`rounds` 64-bit round keys from non-negative ints (seed, epoch, a purpose...): a
    read-only array, kept for the next batch of the same epoch (SeedSequence takes about
    30 us, a tenth of a 32-sample batch's order)."""
    return _keys(tuple(int(w) for w in words), rounds)


@functools.lru_cache(maxsize=1024)
def _keys(words: tuple[int, ...], rounds: int) -> np.ndarray:
    state = np.random.SeedSequence(list(words)).generate_state(rounds, np.uint64)
    keys = np.asarray(state, dtype=np.uint64)
    keys.setflags(write=False)
    return keys


def _half_bits(n: int) -> int:
    bits = max(int(n - 1).bit_length(), 2)
    return (bits + 1) // 2


def _network(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    """The network over uint64 `x` (a new array). In place, two scratch arrays: a batch's
    order is a few dozen ufunc calls on a few dozen values, where each call's allocation
    was a third of its cost."""
    h = np.uint64(half)
    drop = np.uint64(64 - half)
    left = x >> h
    right = x & np.uint64((1 << half) - 1)
    t, u = np.empty_like(x), np.empty_like(x)
    for k in keys:
        np.bitwise_xor(right, k, out=t)
        np.right_shift(t, _S30, out=u)
        t ^= u
        t *= _M1
        np.right_shift(t, _S27, out=u)
        t ^= u
        t *= _M2
        np.right_shift(t, _S31, out=u)
        t ^= u  # mix64(right ^ k)
        t >>= drop
        t ^= left
        left, right, t = right, t, left
    left <<= h
    left |= right
    return left


_MASK64 = (1 << 64) - 1
# Values still to walk at or below this many: Python ints, about 5 us each a pass, against
# a fixed 40-80 us a pass for numpy's calls however few the values.
_FEW = 8


def _walk_few(v: int, n: int, half: int, keys: tuple[int, ...]) -> int:
    """Cycle walking for one value (>= n) in Python ints: _network's arithmetic mod 2**64."""
    mask, drop = (1 << half) - 1, 64 - half
    m1, m2 = int(_M1), int(_M2)
    while v >= n:
        left, right = v >> half, v & mask
        for k in keys:
            z = right ^ k
            z = ((z ^ (z >> 30)) * m1) & _MASK64
            z = ((z ^ (z >> 27)) * m2) & _MASK64
            left, right = right, left ^ ((z ^ (z >> 31)) >> drop)
        v = (left << half) | right
    return v


def permute(x: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """The keyed permutation of [0, n) at each of `x` (int64, all in [0, n)): int64, a new
    array."""
    if not 0 <= n <= MAX_N:
        raise ValueError(f"n must be in [0, 2**62], got {n}")
    x = np.asarray(x, dtype=np.int64)
    if n <= 1 or not len(x):
        return x.copy()
    half = _half_bits(n)
    out = _network(x.astype(np.uint64), half, keys)
    limit = np.uint64(n)
    todo = np.flatnonzero(out >= limit)
    while len(todo) > _FEW:  # cycle walking: ends, see the module docstring
        again = _network(out[todo], half, keys)
        out[todo] = again
        todo = todo[again >= limit]
    if len(todo):
        words = tuple(int(k) for k in keys)
        for i in todo.tolist():
            out[i] = _walk_few(int(out[i]), n, half, words)
    return out.astype(np.int64)


def permute_each(x: np.ndarray, n: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Like `permute`, each value under its own domain size and keys: x[i] in [0, n[i]),
    keys[i] its round keys (shape [len(x), rounds]). For block shuffles, where each window of
    shards is permuted by its own key."""
    x = np.asarray(x, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    out = x.copy()
    for size in np.unique(n).tolist():  # the same size: the same number of bits
        at = np.flatnonzero(n == size)
        if size <= 1:
            continue
        half = _half_bits(size)
        h, mask = np.uint64(half), np.uint64((1 << half) - 1)
        drop = np.uint64(64 - half)
        cur = x[at].astype(np.uint64)
        rows = keys[at]
        todo = np.arange(len(at))
        while len(todo):
            left, right = cur[todo] >> h, cur[todo] & mask
            for r in range(rows.shape[1]):
                left, right = right, left ^ (mix64(right ^ rows[todo, r]) >> drop)
            cur[todo] = (left << h) | right
            todo = todo[cur[todo] >= np.uint64(size)]
        out[at] = cur.astype(np.int64)
    return out


def window_keys(keys: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """Round keys of each window number, derived from an epoch's keys: [len(windows),
    rounds] uint64."""
    w = mix64(np.asarray(windows, dtype=np.int64).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    return mix64(w[:, None] ^ keys[None, :])
