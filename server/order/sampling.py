"""Which samples make batch k: a pure function of the coordinates.

An epoch's order comes in two named versions (`Coordinates.order`):

- ORDER_INDEX ("index", the default of new runs): a keyed bijection of the epoch's positions
  evaluated per position (order/permute.py). A batch's samples cost O(batch) time and memory
  whatever the dataset's size; nothing is cached but a block shuffle's shard order (small).
- ORDER_LEGACY ("legacy", what stoker did before, and what requests that name no order get):
  the whole epoch's permutation, `default_rng([seed, epoch]).permutation(n)`, materialized and
  kept in `ORDERS`, bounded in bytes. It stays so that checkpoints saved under it resume the
  same order exactly; docs/design.md, "Orders".

Index arrays are numpy, never Python lists (lists of Python ints in forked processes grow
memory by copy-on-write).

`Exclusion`, samples a run leaves out (part of the coordinates: `excluded`): a set of dataset
indices dropped from every batch that holds them, the rest of the order unchanged.

Positions are not renumbered: batch k is the same slice of the epoch's order with or without
an exclusion, less the excluded samples it held (so it has that many fewer rows). That is
what keeps resume, seek and elastic resume exact with an exclusion: consumed positions are
still a prefix of the order. The set travels with the coordinates (the list, bounded by
MAX_EXCLUDED, and its digest, which names it in cache keys and proves the list whole).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from .._lru import LRU
from .permute import keys_for, permute, permute_each, window_keys

# Order versions, by number on the wire and in checkpoints, by name for users.
ORDER_LEGACY = 1
ORDER_INDEX = 2
ORDER_NAMES = {ORDER_LEGACY: "legacy", ORDER_INDEX: "index"}
ORDERS_KNOWN = tuple(ORDER_NAMES)


class CoordinateError(ValueError):
    """Coordinates no dataset can satisfy; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# Indices one run may exclude: a request carries them all (10 bytes each at most), and
# gRPC's default message limit is 4 MiB.
MAX_EXCLUDED = 100_000


def digest_of(indices: np.ndarray) -> str:
    """`sha256:<hex>` of the sorted, distinct indices as little-endian int64 (the client
    computes the same: client/position/exclusions.py)."""
    return "sha256:" + hashlib.sha256(np.asarray(indices, "<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class Exclusion:
    """A checked set of excluded sample indices; equal (and hashed) by its digest."""

    digest: str
    indices: np.ndarray = field(compare=False, hash=False, repr=False)  # sorted, distinct

    @classmethod
    def of(cls, indices: list[int], digest: str, num_samples: int) -> Exclusion | None:
        """The exclusion a request names (None for none); CoordinateError naming `excluded`
        when it is too long, holds an index out of the dataset, is not sorted and distinct,
        or `digest` is not its digest."""
        if not indices and not digest:
            return None
        if len(indices) > MAX_EXCLUDED:
            raise CoordinateError("excluded", f"{len(indices)} indices, at most "
                                              f"{MAX_EXCLUDED} may be excluded")
        arr = np.asarray(indices, dtype=np.int64)
        if len(arr) and (arr[0] < 0 or arr[-1] >= num_samples):
            raise CoordinateError("excluded", f"indices must be in [0, {num_samples}), got "
                                              f"{int(arr.min())}..{int(arr.max())}")
        if len(arr) > 1 and not bool((np.diff(arr) > 0).all()):
            raise CoordinateError("excluded", "indices must be sorted and distinct")
        if digest != digest_of(arr):
            raise CoordinateError("excluded_digest", f"is not the digest of the {len(arr)} "
                                                     "indices sent (sha256 of them as "
                                                     "little-endian int64)")
        arr.flags.writeable = False
        return cls(digest, arr)

    def drop(self, samples: np.ndarray) -> np.ndarray:
        """`samples` without the excluded ones, in their order."""
        return samples[~np.isin(samples, self.indices)]


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
    # Samples left out of every batch (Exclusion, above), or None.
    excluded: Exclusion | None = None
    order: int = ORDER_LEGACY  # the order version (ORDER_NAMES); a request naming none: legacy

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
        if self.order not in ORDER_NAMES:
            raise CoordinateError("order", f"must be one of {sorted(ORDER_NAMES)} "
                                           f"({', '.join(ORDER_NAMES.values())}), got "
                                           f"{self.order}: a newer client than this server?")
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


class _HasNbytes(Protocol):
    @property
    def nbytes(self) -> int: ...


Kept = TypeVar("Kept", bound=_HasNbytes)


def _nbytes(value: _HasNbytes) -> int:
    return value.nbytes


class OrderCache(Generic[Kept]):
    """Epoch orders by key, least recently used out first, at most `max_bytes` in all. Any
    thread.

    One order is computed at a time: two callers wanting the same order compute it once, and
    memory peaks at the cap plus the order being computed. An order larger than the cap is
    computed for its caller and not kept."""

    def __init__(self, max_bytes: int) -> None:
        self._items: LRU[Hashable, Kept] = LRU(max_size=max_bytes, size=_nbytes)
        self._lock = threading.Lock()  # guards _items
        # Reentrant: a mixture's epoch order is computed from its components' (order/mixture.py).
        self._computing = threading.RLock()

    def get(self, key: Hashable, compute: Callable[[], Kept]) -> Kept:
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
                    self._items.put(key, value)
            return value

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self._items.resize(max_bytes)

    @property
    def max_bytes(self) -> int:
        return self._items.max_size or 0

    @property
    def nbytes(self) -> int:
        """The bytes of the orders kept."""
        return self._items.size

    def _cached(self, key: Hashable) -> Kept | None:
        with self._lock:
            return self._items.get(key)


# The process's epoch orders, all datasets: the server sets the cap from max_order_cache_bytes.
ORDERS: OrderCache[np.ndarray] = OrderCache(1 << 30)


class Ordering:
    """How one dataset's samples are ordered in an epoch.

    global: a permutation of all samples. block: the shards (files, tar shards, row groups;
    `shard_starts` gives each one's first sample) in a random order, then the samples of each
    window of `window` consecutive shards shuffled together, so a reader goes through a few
    shards at a time, each from start to end. Both are functions of (seed, epoch) alone, in
    either order version (see the module docstring). Any thread.
    """

    def __init__(self, num_samples: int, shard_starts: np.ndarray | None = None,
                 block: bool = False, window: int = 1) -> None:
        self.num_samples = num_samples
        self.block = block and shard_starts is not None and len(shard_starts) > 1
        starts = np.asarray(shard_starts if self.block else [0], dtype=np.int64)
        self.shard_starts = starts
        self.shard_ends = np.append(starts[1:], num_samples)
        self.window = window
        self._shard_orders = _SmallCache(SHARD_ORDERS_KEPT)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_shard_orders"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _shard_orders=_SmallCache(SHARD_ORDERS_KEPT))

    def epoch(self, seed: int, epoch: int, shuffle: bool, order: int = ORDER_LEGACY
              ) -> np.ndarray:
        """The whole dataset's order for one epoch (read-only int64 array). Legacy orders come
        from ORDERS; an index order is computed for the caller (tests, tools: O(n))."""
        if order == ORDER_INDEX:
            whole = self.indices(np.arange(self.num_samples, dtype=np.int64), seed, epoch,
                                 shuffle, order)
            whole.flags.writeable = False
            return whole
        if not shuffle:
            return self._order(seed, epoch, shuffle)
        return ORDERS.get((self, seed, epoch), lambda: self._order(seed, epoch, shuffle))

    def indices(self, positions: np.ndarray, seed: int, epoch: int, shuffle: bool,
                order: int = ORDER_LEGACY) -> np.ndarray:
        """The dataset indices at an epoch's `positions` (a mixture's ordering maps them
        through its components instead: server/order/mixture.py)."""
        if not shuffle:
            return positions
        if order == ORDER_LEGACY:
            return self.epoch(seed, epoch, shuffle)[positions]
        positions = np.asarray(positions, dtype=np.int64)
        if not self.block:
            return permute(positions, self.num_samples, keys_for(seed, epoch, _SALT_GLOBAL))
        return self._block_indices(positions, seed, epoch)

    def _shards(self, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the epoch's shard order, each slot's first position in it: len + 1), cached: a
        few int64 per shard."""
        def make() -> tuple[np.ndarray, np.ndarray]:
            count = len(self.shard_starts)
            shards = permute(np.arange(count, dtype=np.int64), count,
                             keys_for(seed, epoch, _SALT_SHARDS))
            sizes = (self.shard_ends - self.shard_starts)[shards]
            firsts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            return shards, firsts
        return self._shard_orders.get((seed, epoch), make)

    def _block_indices(self, positions: np.ndarray, seed: int, epoch: int) -> np.ndarray:
        """Block shuffle by index: position p lies in window w of the shard order (its
        shards' samples at [lo, hi)); the window's own keyed permutation moves it within."""
        shards, firsts = self._shards(seed, epoch)
        count, window = len(shards), self.window
        slot = np.searchsorted(firsts, positions, side="right") - 1
        w = slot // window
        lo = firsts[w * window]
        hi = firsts[np.minimum(w * window + window, count)]
        keys = window_keys(keys_for(seed, epoch, _SALT_WINDOWS), w)
        at = lo + permute_each(positions - lo, hi - lo, keys)
        slot = np.searchsorted(firsts, at, side="right") - 1
        return self.shard_starts[shards[slot]] + (at - firsts[slot])

    def _order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """The legacy order (ORDER_LEGACY), whole: kept as it was, for old checkpoints."""
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


# What an index order's keys are drawn for, besides (seed, epoch): each its own stream.
_SALT_GLOBAL, _SALT_SHARDS, _SALT_WINDOWS = 0x6F72646572, 0x7368617264, 0x77696E646F77
SHARD_ORDERS_KEPT = 8  # block shuffles' shard orders kept per dataset (a few int64 a shard)


class _SmallCache:
    """At most `most` values by key, the oldest out first; a value is made outside the lock
    (two threads may both make it: it is a pure function). Any thread."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._items: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        with self._lock:
            found = self._items.get(key)
        if found is not None:
            return found
        value = make()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.most:
                self._items.pop(next(iter(self._items)))
        return value


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
    order = ordering.epoch(c.seed, c.epoch, c.shuffle, c.order)
    return order[c.start + c.rank : stop : c.world_size]


def batches_per_epoch(num_samples: int, c: Coordinates) -> int:
    per_rank = samples_per_rank(num_samples, c)
    if c.drop_last:
        return per_rank // c.batch_size
    return -(-per_rank // c.batch_size)


def check_batch_index(batch_index: int, batches: int) -> None:
    """CoordinateError naming `batch_index` unless it is one of the epoch's `batches`."""
    if not 0 <= batch_index < batches:
        raise CoordinateError("batch_index", f"must be in [0, {batches}) for this epoch and "
                                             f"rank, got {batch_index}")


# Index orders (ORDER_INDEX) are computed for about CHUNK_SAMPLES positions at once: the
# batches of a chunk (CHUNK_SAMPLES // batch_size of them, from a multiple of that) are made
# together and kept (CHUNKS_KEPT chunks, 4 KiB each: two each for 32 streams reading at
# once; each new epoch adds chunks until the oldest go, so this is all the front end holds of
# orders, 256 KiB, reached within 33,000 batches of 1 sample). A batch's order is a few dozen
# numpy calls whatever its size (0.3-0.4 ms of the front end's CPU for 32 samples on the 2-core
# machine, a quarter of its time a batch in benchmarks/lockstep.py); 512 cost about what 32
# do. Memoized, not changed: a batch is still a pure function of its coordinates.
CHUNK_SAMPLES = 512
CHUNKS_KEPT = 64
_CHUNKS = _SmallCache(CHUNKS_KEPT)


def batch_samples(ordering: Ordering, c: Coordinates, batch_index: int) -> np.ndarray:
    """Dataset indices of batch `batch_index` under coordinates `c` (validated): a new array,
    which keeps no epoch order alive. Unshuffled, no order is made at all."""
    check_batch_index(batch_index, batches_per_epoch(ordering.num_samples, c))
    per_rank = samples_per_rank(ordering.num_samples, c)
    chunk = CHUNK_SAMPLES // c.batch_size
    if c.shuffle and c.order != ORDER_LEGACY and chunk > 1:
        first = batch_index // chunk * chunk * c.batch_size
        stop = min(first + chunk * c.batch_size, per_rank)
        key = (ordering, c.seed, c.epoch, c.order, c.start, c.rank, c.world_size, first, stop)
        made = _CHUNKS.get(key, lambda: _read_only(_positions(ordering, c, first, stop)))
        at = batch_index * c.batch_size - first
        return made[at:at + c.batch_size].copy()
    first = batch_index * c.batch_size
    return _positions(ordering, c, first, min(first + c.batch_size, per_rank))


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _positions(ordering: Ordering, c: Coordinates, first: int, stop: int) -> np.ndarray:
    """Dataset indices of this rank's samples first..stop (a new array)."""
    # This rank's j-th sample is at position start + rank + j * world_size of the epoch's order.
    at = c.start + c.rank
    positions = np.arange(at + first * c.world_size, at + stop * c.world_size, c.world_size,
                          dtype=np.int64)
    return ordering.indices(positions, c.seed, c.epoch, c.shuffle, c.order)
