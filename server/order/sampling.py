"""Which samples make batch k: a pure function of the coordinates.

Orderings are numpy index arrays computed from (seed, epoch) and cached, never Python lists
(lists of Python ints in forked processes grow memory by copy-on-write). The cache of epoch
orders is bounded in bytes (`ORDERS`): a client choosing many seeds of a large dataset makes
the server compute orders again, never hold them all.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .exclusion import Exclusion


class CoordinateError(ValueError):
    """Coordinates no dataset can satisfy; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Coordinates:
    dataset: str
    seed: int
    epoch: int
    shuffle: bool
    rank: int
    world_size: int
    batch_size: int
    drop_last: bool
    # Positions of this epoch's order consumed before these coordinates took over (a run
    # resumed at another world_size or batch_size); the epoch goes on from there. 0: all.
    start: int = 0
    # > 0: batches cut by tokens instead (server/order/token_batches.py); batch_size is then 0.
    batch_tokens: int = 0
    token_cost: str = "tokens"  # with batch_tokens: what ranks are balanced by
    # Samples left out of every batch (server/order/exclusion.py's Exclusion), or None.
    excluded: Exclusion | None = None

    def validate(self, num_samples: int | None = None) -> None:
        """Raise CoordinateError naming the first field no dataset (or, given its size, this
        one) can satisfy."""
        if self.batch_tokens < 0:
            raise CoordinateError("batch_tokens", f"must be >= 0, got {self.batch_tokens}")
        if self.batch_tokens and self.batch_size:
            raise CoordinateError("batch_size", f"must be 0 with batch_tokens="
                                                f"{self.batch_tokens}, got {self.batch_size}: "
                                                "give batch_size or batch_tokens, not both")
        if not self.batch_tokens and self.batch_size <= 0:
            raise CoordinateError("batch_size", f"must be >= 1, got {self.batch_size}")
        if self.world_size <= 0:
            raise CoordinateError("world_size", f"must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise CoordinateError(
                "rank", f"must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.seed < 0:
            raise CoordinateError("seed", f"must be >= 0, got {self.seed}")
        if self.epoch < 0:
            raise CoordinateError("epoch", f"must be >= 0, got {self.epoch}")
        if self.start < 0:
            raise CoordinateError("start", f"must be >= 0, got {self.start}")
        if num_samples is not None and self.start > num_samples:
            raise CoordinateError(
                "start", f"must be <= the epoch's {num_samples} positions (dataset "
                         f"{self.dataset!r}), got {self.start}")
        if num_samples is not None and self.world_size > max(num_samples, 1):
            # Each rank takes num_samples // world_size samples: none at all, silently.
            raise CoordinateError(
                "world_size", f"{self.world_size} ranks but dataset {self.dataset!r} has "
                              f"{num_samples} samples: every rank would get none")


@dataclass(frozen=True)
class EpochKey:
    """What a sample's content may depend on besides its index: augmentation randomness and
    packing plans are functions of (seed, epoch, shuffle, index), never of which server,
    worker or batch builds it."""

    seed: int = 0
    epoch: int = 0
    shuffle: bool = False

    def rng(self, index: int, stream: int = 0) -> np.random.Generator:
        """Sample `index`'s generator; `stream` separates independent users (0: built-in
        transforms, 1: the user's transform)."""
        return np.random.default_rng([self.seed, self.epoch, index, stream])


# Seed 0, epoch 0, unshuffled: the key of a plain `dataset[i]`, and the default where none is given.
FIRST_EPOCH = EpochKey()


class OrderCache:
    """Epoch orders by key, least recently used out first, at most `max_bytes` in all. Any
    thread.

    One order is computed at a time: two callers wanting the same order compute it once, and
    memory peaks at the cap plus the order being computed. An order larger than the cap is
    computed for its caller and not kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[Hashable, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()  # guards _items and nbytes
        # Reentrant: a mixture's epoch order is computed from its components' (order/mixture.py).
        self._computing = threading.RLock()
        self.nbytes = 0

    def get(self, key: Hashable, compute: Callable[[], np.ndarray]) -> np.ndarray:
        found = self._cached(key)
        if found is not None:
            return found
        with self._computing:
            found = self._cached(key)  # computed by the caller this one waited for
            if found is not None:
                return found
            value = compute()
            with self._lock:
                if value.nbytes <= self.max_bytes:
                    self._items[key] = value
                    self.nbytes += value.nbytes
                self._trim()
            return value

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            self._trim()

    def _cached(self, key: Hashable) -> np.ndarray | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def _trim(self) -> None:
        while self.nbytes > self.max_bytes and self._items:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes


# The process's epoch orders, all datasets: the server sets the cap from max_order_cache_bytes.
ORDERS = OrderCache(1 << 30)


class Ordering:
    """How one dataset's samples are ordered in an epoch.

    global: a permutation of all samples. block: the shards (files, tar shards, row groups;
    `shard_starts` gives each one's first sample) in a random order, then the samples of each
    window of `window` consecutive shards shuffled together, so a reader goes through a few
    shards at a time, each from start to end. Both are functions of (seed, epoch) alone.
    """

    def __init__(self, num_samples: int, shard_starts: np.ndarray | None = None,
                 block: bool = False, window: int = 1) -> None:
        self.num_samples = num_samples
        self.block = block and shard_starts is not None and len(shard_starts) > 1
        starts = np.asarray(shard_starts if self.block else [0], dtype=np.int64)
        self.shard_starts = starts
        self.shard_ends = np.append(starts[1:], num_samples)
        self.window = window

    def epoch(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """The whole dataset's order for one epoch (read-only int64 array), from ORDERS."""
        if not shuffle:
            return self._order(seed, epoch, shuffle)
        return ORDERS.get((self, seed, epoch), lambda: self._order(seed, epoch, shuffle))

    def indices(self, positions: np.ndarray, seed: int, epoch: int, shuffle: bool
                ) -> np.ndarray:
        """The dataset indices at an epoch's `positions` (a mixture's ordering maps them
        through its components instead: server/order/mixture.py)."""
        if not shuffle:
            return positions
        return self.epoch(seed, epoch, shuffle)[positions]

    def _order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        n = self.num_samples
        if not shuffle:
            order = np.arange(n, dtype=np.int64)
        elif not self.block:
            order = np.random.default_rng([seed, epoch]).permutation(n)
        else:
            rng = np.random.default_rng([seed, epoch])
            shards = rng.permutation(len(self.shard_starts))
            parts = []
            for w in range(0, len(shards), self.window):
                picked = shards[w : w + self.window]
                members = np.concatenate([
                    np.arange(self.shard_starts[s], self.shard_ends[s], dtype=np.int64)
                    for s in picked])
                parts.append(rng.permutation(members))
            order = np.concatenate(parts) if parts else np.arange(0, dtype=np.int64)
        order.flags.writeable = False
        return order


def samples_per_rank(num_samples: int, c: Coordinates) -> int:
    """Each rank's share of the epoch's positions from `c.start` on: the rest of the order
    cut to a multiple of world_size."""
    return max(num_samples - c.start, 0) // c.world_size


def rank_samples(ordering: Ordering, c: Coordinates) -> np.ndarray:
    """This rank's samples for the epoch, in order.

    Same partition as torch's DistributedSampler(drop_last=True), over the positions from
    `c.start` on: they are cut to a multiple of world_size and rank r takes positions
    start + r, start + r + world_size, ... so across ranks every sample appears at most once
    per epoch, and none of the `start` positions consumed before.
    """
    stop = c.start + samples_per_rank(ordering.num_samples, c) * c.world_size
    order = ordering.epoch(c.seed, c.epoch, c.shuffle)
    return order[c.start + c.rank : stop : c.world_size]


def batches_per_epoch(num_samples: int, c: Coordinates) -> int:
    per_rank = samples_per_rank(num_samples, c)
    if c.drop_last:
        return per_rank // c.batch_size
    return -(-per_rank // c.batch_size)


def batch_samples(ordering: Ordering, c: Coordinates, batch_index: int) -> np.ndarray:
    """Dataset indices of batch `batch_index` under coordinates `c` (validated): a new array,
    which keeps no epoch order alive. Unshuffled, no order is made at all."""
    n = batches_per_epoch(ordering.num_samples, c)
    if not 0 <= batch_index < n:
        raise CoordinateError(
            "batch_index", f"must be in [0, {n}) for this epoch and rank, got {batch_index}")
    first = batch_index * c.batch_size
    stop = min(first + c.batch_size, samples_per_rank(ordering.num_samples, c))
    # This rank's j-th sample is at position start + rank + j * world_size of the epoch's order.
    at = c.start + c.rank
    positions = np.arange(at + first * c.world_size, at + stop * c.world_size, c.world_size,
                          dtype=np.int64)
    return ordering.indices(positions, c.seed, c.epoch, c.shuffle)
