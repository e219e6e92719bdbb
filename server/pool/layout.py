"""A built batch as it lies in shared memory: its segment's name and each tensor's place.

What a worker sends the pool (pool/messages.py `Built`) and what the front end encodes and
sends (front/frame_encoding.py, the transports): a leaf that imports nothing of ours, so that either
side can name a batch without importing how one is built.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 64
SAMPLE_INDEX = "sample_index"
SOURCES = "sources"  # the one field of a Task.sources batch: JSON, a string per sample


@dataclass(frozen=True)
class TensorLayout:
    name: str
    dtype: str  # numpy dtype name, data little-endian
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BuiltBatch:
    """A batch payload in a named shared-memory segment (see shm.py); the receiver unlinks it."""

    shm_name: str
    payload_bytes: int
    tensors: tuple[TensorLayout, ...]
    num_samples: int  # rows of every tensor: the batch's sample count, for metrics
    skipped: int = 0  # samples replaced under on_error: skip
    build_seconds: float = 0.0  # the worker's time to build it
