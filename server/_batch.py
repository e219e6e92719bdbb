"""Build one batch: fetch its samples, collate them straight into one shared-memory payload.

Collation follows torch's default_collate for what a dataset returns: numpy arrays and numpy
scalars keep their dtype, Python int -> int64, float -> float64, bool -> bool. Every tensor is
laid out C-contiguous and little-endian at a 64-byte aligned offset of one payload, which is
what travels on the wire; the front end reads it from shared memory without unpickling.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _shm

log = logging.getLogger("stoker.server")

ALIGN = 64
SAMPLE_INDEX = "sample_index"


class SampleError(Exception):
    """A sample could not be read or collated; the message names the sample and the cause."""


@dataclass(frozen=True)
class TensorLayout:
    name: str
    dtype: str  # numpy dtype name, data little-endian
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BuiltBatch:
    """A batch payload in a named shared-memory segment (see _shm); the receiver unlinks it."""

    shm_name: str
    payload_bytes: int
    tensors: tuple[TensorLayout, ...]
    skipped: int = 0  # samples replaced under on_error: skip


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, bool):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, int):
        return np.asarray(value, dtype=np.int64)
    if isinstance(value, float):
        return np.asarray(value, dtype=np.float64)
    if isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"dtype {arr.dtype} is not a number type")
        return arr
    raise TypeError(f"{type(value).__name__} is not a numpy array or number")


# on_error: skip tries at most this many replacements for one bad sample.
MAX_REPLACEMENTS = 16
_logged: set[int] = set()  # bad samples this process has logged (each once)


def replacement(index: int, attempt: int, num_samples: int) -> int:
    """The sample that stands in for a bad one: the same on every server and every run."""
    return int(np.random.default_rng([index, attempt]).integers(num_samples))


def fetch_sample(dataset: Any, i: int) -> dict[str, np.ndarray]:
    try:
        raw = dataset[i]
    except Exception as e:  # the user's code: any failure is this sample's failure
        where = getattr(dataset, "source_of", None)
        place = where(i) if where else ""
        # Formats' own errors often name the place already: say it once.
        src = f" ({place})" if place and place not in str(e) else ""
        raise SampleError(f"sample {i}{src}: {type(e).__name__}: {e}") from e
    if not isinstance(raw, dict):
        raise SampleError(f"sample {i}: expected a dict of fields, got {type(raw).__name__}")
    try:
        return {str(k): _as_array(v) for k, v in raw.items()}
    except (TypeError, OverflowError) as e:  # OverflowError: an int beyond int64
        raise SampleError(f"sample {i}: {e}") from None


def fetch_samples(dataset: Any, indices: np.ndarray, skip: bool = False
                  ) -> tuple[list[dict[str, np.ndarray]], np.ndarray, int]:
    """The samples of `indices`, the indices actually delivered (a bad sample replaced under
    `skip`), and how many were replaced."""
    samples, delivered, skipped = [], indices.copy(), 0
    for pos, i in enumerate(indices.tolist()):
        try:
            samples.append(fetch_sample(dataset, i))
            continue
        except SampleError as e:
            if not skip:
                raise
            error = e
        for attempt in range(1, MAX_REPLACEMENTS + 1):
            if i not in _logged:
                _logged.add(i)
                log.warning("skipping %s", error)
            j = replacement(i, attempt, len(dataset))
            try:
                samples.append(fetch_sample(dataset, j))
            except SampleError as e:
                error = e
                i = j
                continue
            delivered[pos] = j
            skipped += 1
            break
        else:
            raise SampleError(f"{error} (and {MAX_REPLACEMENTS} replacements failed too)")
    return samples, delivered, skipped


def plan_layout(samples: list[dict[str, np.ndarray]], indices: np.ndarray) -> list[TensorLayout]:
    """Where each collated field goes in the payload; checks samples agree on keys and shapes."""
    first = samples[0]
    if SAMPLE_INDEX in first:
        raise SampleError(f"sample {indices[0]}: field name {SAMPLE_INDEX!r} is reserved")
    fields = [(k, v.dtype, v.shape) for k, v in first.items()]
    fields.append((SAMPLE_INDEX, np.dtype(np.int64), ()))
    for idx, s in zip(indices.tolist(), samples, strict=True):
        if s.keys() != first.keys():
            raise SampleError(
                f"sample {idx}: fields {sorted(s)} differ from sample {indices[0]}'s "
                f"{sorted(first)}")
        for k, dtype, shape in fields[:-1]:
            if s[k].shape != shape or s[k].dtype != dtype:
                raise SampleError(
                    f"sample {idx}: field {k!r} is {s[k].dtype}{list(s[k].shape)}, but sample "
                    f"{indices[0]} has {dtype}{list(shape)}; a batch needs equal shapes")
    layout, offset, n = [], 0, len(samples)
    for name, dtype, shape in fields:
        nbytes = n * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        layout.append(TensorLayout(name, dtype.name, (n, *shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout


_segments = itertools.count()


def _segment_name() -> str:
    # Called in worker processes, whose parent is the server: the name says whose it is.
    return f"{_shm.prefix(os.getppid())}{os.getpid()}_{next(_segments)}"


def build_batch(dataset: Any, indices: np.ndarray, skip: bool = False) -> BuiltBatch:
    """Compute the batch of `indices` into a new shared-memory segment (owned by the caller)."""
    samples, indices, skipped = fetch_samples(dataset, indices, skip)
    layout = plan_layout(samples, indices)
    total = layout[-1].offset + layout[-1].nbytes
    name = _segment_name()
    segment = _shm.create(name, total)
    try:
        for t in layout:
            out = np.ndarray(t.shape, np.dtype(t.dtype).newbyteorder("<"), segment, t.offset)
            if t.name == SAMPLE_INDEX:
                out[:] = indices
            else:
                for row, s in enumerate(samples):
                    out[row] = s[t.name]
            del out  # views must be gone before close()
    except BaseException:
        segment.close()
        _shm.unlink(name)
        raise
    segment.close()
    return BuiltBatch(name, total, tuple(layout), skipped)


def probe_fields(dataset: Any) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, per-sample shape) of every output field, from sample 0."""
    if len(dataset) == 0:
        return [(SAMPLE_INDEX, "int64", ())]
    first = np.zeros(1, np.int64)
    layout = plan_layout(fetch_samples(dataset, first)[0], first)
    return [(t.name, t.dtype, t.shape[1:]) for t in layout]
