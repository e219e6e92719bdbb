"""Which samples make batch k: a pure function of the coordinates.

Orderings are numpy index arrays computed from (seed, epoch) and cached, never Python lists
(lists of Python ints in forked processes grow memory by copy-on-write).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


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

    def validate(self) -> None:
        if self.batch_size <= 0:
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

    @functools.lru_cache(maxsize=16)  # noqa: B019 -- a few Orderings live as long as the server
    def epoch(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """The whole dataset's order for one epoch (read-only int64 array)."""
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


def rank_samples(ordering: Ordering, c: Coordinates) -> np.ndarray:
    """This rank's samples for the epoch, in order.

    Same partition as torch's DistributedSampler(drop_last=True): the order is cut to a
    multiple of world_size and rank r takes positions r, r + world_size, ... so across ranks
    every sample appears at most once per epoch.
    """
    per_rank = ordering.num_samples // c.world_size
    order = ordering.epoch(c.seed, c.epoch, c.shuffle)
    return order[c.rank : per_rank * c.world_size : c.world_size]


def batches_per_epoch(num_samples: int, c: Coordinates) -> int:
    per_rank = num_samples // c.world_size
    if c.drop_last:
        return per_rank // c.batch_size
    return -(-per_rank // c.batch_size)


def batch_samples(ordering: Ordering, c: Coordinates, batch_index: int) -> np.ndarray:
    """Dataset indices of batch `batch_index` under coordinates `c` (validated)."""
    n = batches_per_epoch(ordering.num_samples, c)
    if not 0 <= batch_index < n:
        raise CoordinateError(
            "batch_index", f"must be in [0, {n}) for this epoch and rank, got {batch_index}")
    start = batch_index * c.batch_size
    return np.ascontiguousarray(rank_samples(ordering, c)[start : start + c.batch_size])
