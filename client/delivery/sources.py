"""A mixture's samples by component: `SourceCounts`, for stats()["sources"].

A mixture's batches carry a `source` field, each sample's component (its index in the
mixture's `components:`). Counts are read from a batch's host bytes as it is received,
before any copy to a device, and added up when the loop hands the batch out: batches
received ahead and never handed out do not count.

Threading: `received` runs on receive threads, the rest on the loop's thread; they share a
dict whose single-key stores and pops are atomic (the GIL's).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..transport.frames import Assembled


class SourceCounts:
    """Samples handed out by component, and the counts of batches received, not yet handed
    out, by (epoch, batch index)."""

    def __init__(self) -> None:
        self._handed: dict[int, int] = {}
        self._ahead: dict[tuple[int, int], list[int]] = {}

    def received(self, batch: Assembled) -> None:
        """A batch came in: how many of its samples each component gave (none counted
        without an int64 `source` field: not a mixture)."""
        t = next((t for t in batch.tensors if t.name == "source"), None)
        if t is None or t.dtype != "int64":
            return
        raw = batch.buffer[t.offset : t.offset + t.nbytes]
        data = raw if isinstance(raw, np.ndarray) else raw.numpy()  # a pinned torch tensor
        counts = np.bincount(np.frombuffer(np.ascontiguousarray(data), "<i8"))
        self._ahead[(batch.epoch, batch.batch_index)] = counts.tolist()

    def handed_out(self, epoch: int, batch_index: int) -> None:
        """The loop handed this batch out: its counts count."""
        for source, n in enumerate(self._ahead.pop((epoch, batch_index), [])):
            self._handed[source] = self._handed.get(source, 0) + n

    def forget_ahead(self) -> None:
        """A pass ended: what was received ahead is never handed out."""
        self._ahead.clear()

    def stats(self) -> dict[str, Any]:
        """{"sources": {component: samples}} once a mixture's batch was handed out, else {}."""
        return {"sources": dict(sorted(self._handed.items()))} if self._handed else {}
