"""`epoch()`: one epoch read from real servers through a RemoteLoader, the helper every test
that reads a whole epoch shares; a test names only the coordinates and options it cares about."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from stoker.client import RemoteLoader


class Epoch(list):
    """The epoch's batches, in order, each array copied out of the loader's buffers, and
    `stats`, the loader's stats() after the last batch, and `length`, its len()."""

    stats: dict[str, Any]
    length: int

    def arrays(self) -> dict[str, np.ndarray]:
        """Each field's batches concatenated."""
        return {k: np.concatenate([b[k] for b in self]) for k in self[0]}

    def indices(self) -> list[int]:
        """The sample indices, in the order they came."""
        return [int(i) for b in self for i in b["sample_index"]]


def epoch(address: Any, dataset: str, *, set_epoch: int | None = None,
          on_batch: Callable[[int], object] | None = None, **kw: Any) -> Epoch:
    """Every batch of RemoteLoader(address, dataset, output="numpy", timeout=60, **kw) (an
    address, a list of them, or a server with `.address`); `set_epoch` first when given;
    `on_batch(k)` after batch k arrives (a fault to inject mid-epoch)."""
    address = getattr(address, "address", address)
    out = Epoch()
    with RemoteLoader(address, dataset, **{"output": "numpy", "timeout": 60, **kw}) as loader:
        if set_epoch is not None:
            loader.set_epoch(set_epoch)
        for k, batch in enumerate(loader):
            out.append({name: np.array(v, copy=True) for name, v in batch.items()})
            if on_batch is not None:
                on_batch(k)
        out.stats, out.length = loader.stats(), len(loader)
    return out
