"""Which shard holds a sample, for formats whose samples lie in shards (files, tar shards,
row groups), each shard's samples numbered on from the previous shard's."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ShardIndex:
    """Shard k holds samples [starts[k], starts[k + 1]); a shard may hold none.

    Fixed-width numpy arrays, never changed after open: nothing for copy-on-write to touch in
    forked workers, and any thread may read them."""

    def __init__(self, counts: Sequence[int] | np.ndarray) -> None:
        counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.length = int(self.starts[-1])
        # The first sample of every shard that has one: what `shuffle: block` permutes
        # (the Dataset contract's `shard_starts`).
        self.shard_starts = self.starts[:-1][counts > 0]

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, position in it) of sample `index`; IndexError outside [0, length)."""
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} not in [0, {self.length})")
        shard = int(self._shard_of(index))
        return shard, index - int(self.starts[shard])

    def shards_of(self, indices: np.ndarray) -> np.ndarray:
        """The shards these samples lie in, each once, ascending (what `objects_of` reads)."""
        return np.unique(self._shard_of(indices))

    def _shard_of(self, index: int | np.ndarray) -> np.ndarray:
        # side="right": a shard with no samples is never chosen, the next one starting there is.
        return np.searchsorted(self.starts, index, side="right") - 1
