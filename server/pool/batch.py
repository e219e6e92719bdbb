"""Build one batch: fetch its samples, collate them straight into one shared-memory payload.

Collation follows torch's default_collate for what a dataset returns: numpy arrays and numpy
scalars keep their dtype, Python int -> int64, float -> float64, bool -> bool. Every tensor is
laid out C-contiguous and little-endian at a 64-byte aligned offset of one payload, which is
what travels on the wire; the front end reads it from shared memory without unpickling.

A field whose size varies from sample to sample (images served at their native size) comes
as a `Padded` array: the batch is then zero-padded at the end of those axes to its largest
sample. Such a batch is gathered before it is laid out (its shape is known only then), so it
briefly holds its samples twice; the others are written into the payload as they come.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..formats.samples import Padded, SampleError, fetch_sample
from ..order.sampling import FIRST_EPOCH, EpochKey
from ..sources import DataChanged
from . import shm
from .layout import ALIGN, SAMPLE_INDEX, SOURCES, BuiltBatch, TensorLayout

if TYPE_CHECKING:
    from ..formats import DatasetParts

log = logging.getLogger("stoker.server")

class BatchTooLarge(Exception):
    """A batch over the server's max_batch_bytes; the message names the limit and its value."""


MAX_REPLACEMENTS = 16
_logged: set[int] = set()  # bad samples this process has logged (each once)


def replacement(index: int, attempt: int, num_samples: int) -> int:
    """The sample that stands in for a bad one: the same on every server and every run."""
    return int(np.random.default_rng([index, attempt]).integers(num_samples))


def fetch_or_replace(dataset: DatasetParts, i: int, key: EpochKey, skip: bool
                     ) -> tuple[dict[str, np.ndarray], int]:
    """Sample i, or under `skip` the replacement that stands in for it; returns the sample and
    the index actually delivered."""
    try:
        return fetch_sample(dataset, i, key), i
    except SampleError as e:
        # A file changed since the server listed it: whatever stood in for it, the batch
        # would not be the one the fingerprint promises.
        if not skip or isinstance(e.__cause__, DataChanged):
            raise
        error = e
    for attempt in range(1, MAX_REPLACEMENTS + 1):
        if i not in _logged:
            _logged.add(i)
            log.warning("skipping %s", error)
        j = replacement(i, attempt, len(dataset.dataset))
        try:
            return fetch_sample(dataset, j, key), j
        except SampleError as e:
            if isinstance(e.__cause__, DataChanged):
                raise
            error = e
            i = j
    raise SampleError(f"{error} (and {MAX_REPLACEMENTS} replacements failed too)")


_T = TypeVar("_T")
_R = TypeVar("_R")
_threads: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (size, pool)


def in_order(fetch: Callable[[_T], _R], items: list[_T], threads: int = 1) -> Iterator[_R]:
    """fetch(item) for each item, in order. threads > 1: up to that many fetched at once by
    this process's sample threads, for datasets whose samples spend their time in code that
    releases the GIL (video decoding: FFmpeg), where a worker has cores to spare. A failure
    comes out at its place in the order, as it would one at a time; the fetches already
    started are waited for first (a worker builds one batch at a time)."""
    if threads <= 1:
        yield from map(fetch, items)
        return
    global _threads
    if _threads is None or _threads[0] < threads:
        _threads = (threads, concurrent.futures.ThreadPoolExecutor(threads, "stoker-sample"))
    pool, rest = _threads[1], iter(items)
    pending = collections.deque(pool.submit(fetch, item)
                                for item in itertools.islice(rest, threads))
    try:
        while pending:
            done = pending.popleft()
            for item in itertools.islice(rest, 1):
                pending.append(pool.submit(fetch, item))
            yield done.result()
    finally:
        for f in pending:
            f.cancel()
        concurrent.futures.wait(pending)


def plan_layout(first: dict[str, np.ndarray], n: int, first_index: int,
                shapes: dict[str, tuple[int, ...]] | None = None) -> list[TensorLayout]:
    """Where each field of a batch of `n` samples shaped like `first` goes in the payload;
    `shapes` overrides the per-sample shape of some fields (padded ones)."""
    if SAMPLE_INDEX in first:
        raise SampleError(f"sample {first_index}: field name {SAMPLE_INDEX!r} is reserved")
    shapes = shapes or {}
    return list(_layout(tuple((k, v.dtype, shapes.get(k, v.shape)) for k, v in first.items()),
                        n))


@functools.lru_cache(maxsize=64)
def _layout(fields: tuple[tuple[str, np.dtype, tuple[int, ...]], ...], n: int
            ) -> tuple[TensorLayout, ...]:
    """plan_layout's result for these (name, dtype, per-sample shape) fields: the same for
    most batches of a dataset, so made once (np.prod per field per batch was a fifth of a
    worker's time to build a 64 KiB batch of 16 samples)."""
    layout, offset = [], 0
    for name, dtype, shape in (*fields, (SAMPLE_INDEX, np.dtype(np.int64), ())):
        nbytes = n * math.prod(shape) * dtype.itemsize
        layout.append(TensorLayout(name, dtype.name, (n, *shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return tuple(layout)


def planned_layout(fields: list[tuple[str, str, tuple[int, ...]]], n: int
                   ) -> tuple[TensorLayout, ...] | None:
    """The layout of a batch of `n` samples of a dataset whose probed `fields` (DatasetMeta:
    sample_index last) all have fixed shapes: plan_layout's result for any batch whose
    samples all have those fields. None: the probe cannot say (a padded axis, no fields)."""
    if not fields or fields[-1][0] != SAMPLE_INDEX:
        return None
    if any(d < 0 for _, _, shape in fields for d in shape):
        return None  # a padded axis: the batch's shape is known only from its samples
    try:
        return _layout(tuple((name, np.dtype(dtype), tuple(shape))
                             for name, dtype, shape in fields[:-1]), n)
    except TypeError:
        return None


class Misfit(Exception):
    """A sample of a part does not fit the layout planned for its batch."""


def build_part(dataset: DatasetParts, layout: tuple[TensorLayout, ...], first: int,
               indices: np.ndarray, segment: Any,
               key: EpochKey = FIRST_EPOCH, skip: bool = False,
               on_sample: Callable[[int], None] | None = None, threads: int = 1) -> int:
    """Write rows [first, first + len(indices)) of a batch laid out as `layout` into
    `segment` (a writable buffer): what build_batch writes there, given that every sample
    has the planned fields. Returns how many samples were replaced under `skip`; raises
    Misfit at the first sample that does not fit (build_batch then names the difference, or
    lays the batch out otherwise), SampleError at one that cannot be read."""
    views = {t.name: np.ndarray(t.shape, np.dtype(t.dtype).newbyteorder("<"), segment,
                                t.offset) for t in layout}
    names = {t.name for t in layout[:-1]}
    expect = [(t.name, t.shape[1:], np.dtype(t.dtype)) for t in layout[:-1]]
    rows = views[SAMPLE_INDEX]
    skipped = 0
    try:
        def fetch(i: int) -> tuple[dict[str, np.ndarray], int]:
            if on_sample is not None:
                on_sample(i)
            return fetch_or_replace(dataset, i, key, skip)

        todo = indices.tolist()
        got = in_order(fetch, todo, threads)
        for pos, (i, (s, j)) in enumerate(zip(todo, got, strict=True), first):
            if not _like(s, names, expect):
                raise Misfit(f"sample {j}")
            for field_name, value in s.items():
                views[field_name][pos] = value
            rows[pos] = j
            skipped += j != i
    finally:
        views.clear()  # no view of a mapping outlives the part (it may be closed later)
        del rows
    return skipped


def _like(s: dict[str, np.ndarray], names: set[str],
          expect: list[tuple[str, tuple[int, ...], np.dtype]]) -> bool:
    """Whether sample `s` has exactly the fields, shapes and dtypes `expect`s (those of the
    batch's first sample): _check_like's common case, at a fraction of its cost per sample."""
    if s.keys() != names:
        return False
    for name, shape, dtype in expect:
        v = s[name]
        if v.shape != shape or v.dtype != dtype:
            return False
    return True


def _check_like(s: dict[str, np.ndarray], idx: int, layout: list[TensorLayout],
                first_index: int) -> None:
    """Sample `idx` has the fields, dtypes and shapes of the batch's first sample."""
    names = [t.name for t in layout[:-1]]
    if s.keys() != set(names):
        raise SampleError(f"sample {idx}: fields {sorted(s)} differ from sample "
                          f"{first_index}'s {sorted(names)}")
    for t in layout[:-1]:
        v = s[t.name]
        shape = t.shape[1:]
        if isinstance(v, Padded) and v.ndim == len(shape):  # the padded axes may be smaller
            shape = tuple(d if a in v.pad_axes else n for a, (n, d) in
                          enumerate(zip(shape, v.shape, strict=True)))
        if v.shape != shape or v.dtype != np.dtype(t.dtype):
            raise SampleError(
                f"sample {idx}: field {t.name!r} is {v.dtype}{list(v.shape)}, but sample "
                f"{first_index} has {t.dtype}{list(t.shape[1:])}; a batch needs equal shapes")


def build_batch(dataset: DatasetParts, indices: np.ndarray, segments: shm.SegmentPool,
                key: EpochKey = FIRST_EPOCH, skip: bool = False,
                max_bytes: int | None = None,
                on_sample: Callable[[int], None] | None = None, threads: int = 1
                ) -> BuiltBatch:
    """Compute the batch of `indices` into a segment of `segments`, lent to the caller.

    Collated in one pass: the first sample fixes the layout, the segment is created, and each
    sample is written into its row as soon as it exists; no list of samples is kept, unless
    the first sample has a `Padded` field: then every sample is fetched first, since the
    batch's shape is their largest. A batch whose payload would exceed `max_bytes` raises
    BatchTooLarge before any memory is taken for it. `on_sample(i)` is called as sample i is
    started (the pool's watchdog names the sample a hung worker was at), so it must be cheap.
    `threads` > 1: samples are fetched that many at once (see in_order)."""
    started = time.perf_counter()
    delivered = np.array(indices, dtype=np.int64)
    skipped = 0
    name, segment, views, layout = "", None, {}, []
    todo = indices.tolist()

    def fetch(i: int) -> tuple[dict[str, np.ndarray], int]:
        if on_sample is not None:
            on_sample(i)
        return fetch_or_replace(dataset, i, key, skip)

    def took(pos: int, got: tuple[dict[str, np.ndarray], int]) -> dict[str, np.ndarray]:
        nonlocal skipped
        s, j = got
        skipped += j != todo[pos]
        delivered[pos] = j
        return s

    try:
        if not todo:
            raise SampleError("a batch needs at least one sample")
        gathered = [took(0, fetch(todo[0]))]
        first_index = int(delivered[0])
        shapes = None
        if any(isinstance(v, Padded) for v in gathered[0].values()):
            gathered += [took(pos, got) for pos, got in
                         enumerate(in_order(fetch, todo[1:], threads), 1)]
            shapes = _padded_shapes(gathered)
        layout = plan_layout(gathered[0], len(indices), first_index, shapes)
        size = layout[-1].offset + layout[-1].nbytes
        if max_bytes is not None and size > max_bytes:
            raise BatchTooLarge(f"a batch of {len(indices)} samples takes {size} bytes, over "
                                f"this server's max_batch_bytes ({max_bytes}): ask for "
                                "smaller batches")
        name, segment = segments.acquire(size)
        views = {t.name: np.ndarray(t.shape, np.dtype(t.dtype).newbyteorder("<"), segment,
                                    t.offset) for t in layout}
        names = {t.name for t in layout[:-1]}
        expect = [(t.name, t.shape[1:], np.dtype(t.dtype)) for t in layout[:-1]]
        rest = ((pos, took(pos, got)) for pos, got in
                enumerate(in_order(fetch, todo[len(gathered):], threads), len(gathered)))
        for pos, s in itertools.chain(enumerate(gathered), rest):
            if pos and not _like(s, names, expect):  # names the difference, if one matters
                _check_like(s, int(delivered[pos]), layout, first_index)
            for field_name, value in s.items():
                _write(views[field_name], pos, value)
        gathered.clear()
        views[SAMPLE_INDEX][:] = delivered
    except BaseException:
        views.clear()
        if segment is not None:
            segments.discard(name)
        raise
    views.clear()  # the pool may resize the map later: no view of it may outlive the batch
    return BuiltBatch(name, layout[-1].offset + layout[-1].nbytes, tuple(layout), len(indices),
                      skipped, time.perf_counter() - started)


def _padded_shapes(samples: list[dict[str, np.ndarray]]) -> dict[str, tuple[int, ...]]:
    """The batch's per-sample shape of each padded field: the largest along its pad axes
    (samples that do not match the first are left to _check_like to name)."""
    shapes = {}
    for name, v in samples[0].items():
        if isinstance(v, Padded):
            sizes = [s[name].shape for s in samples
                     if name in s and np.ndim(s[name]) == v.ndim]
            shapes[name] = tuple(np.max(sizes, axis=0).tolist()) if v.ndim else ()
    return shapes


def _write(view: np.ndarray, pos: int, value: np.ndarray) -> None:
    """Row `pos` of a batch's field; a smaller padded value is zero-padded at the end."""
    if isinstance(value, Padded) and value.shape != view.shape[1:]:
        view[pos] = 0  # segments are reused: the padding must be written
        region: tuple[int | slice, ...] = (pos, *(slice(0, d) for d in value.shape))
        view[region] = value
    else:
        view[pos] = value


def probe_fields(dataset: DatasetParts) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, per-sample shape) of every output field, from sample 0."""
    if len(dataset.dataset) == 0:
        return [(SAMPLE_INDEX, "int64", ())]
    first = fetch_sample(dataset, 0)
    layout = plan_layout(first, 1, 0)
    # A padded axis's size differs from batch to batch: -1.
    return [(t.name, t.dtype, tuple(-1 if a in getattr(first.get(t.name), "pad_axes", ())
                                    else d for a, d in enumerate(t.shape[1:])))
            for t in layout]


def build_sources(dataset: DatasetParts, indices: np.ndarray, segments: shm.SegmentPool
                  ) -> BuiltBatch:
    """Where each sample of `indices` comes from (the format's `source_of`: file and line,
    row group and row, tar member, object key; "" where it cannot say; and its `place_of`,
    by part), as a batch of one row: SOURCES, the JSON list of {"source": ..., **place} in
    UTF-8. No sample is read."""
    started = time.perf_counter()
    where = [{"source": dataset.source_of(int(i)) if dataset.source_of else "",
              **(dataset.place_of(int(i)) if dataset.place_of else {})} for i in indices]
    raw = np.frombuffer(json.dumps(where).encode(), np.uint8)
    layout = plan_layout({SOURCES: raw}, 1, int(indices[0]) if len(indices) else 0)
    size = layout[-1].offset + layout[-1].nbytes
    name, segment = segments.acquire(size)
    views = {t.name: np.ndarray(t.shape, np.dtype(t.dtype), segment, t.offset) for t in layout}
    views[SOURCES][0] = raw
    views[SAMPLE_INDEX][:] = len(indices)
    views.clear()
    return BuiltBatch(name, size, tuple(layout), 1, 0, time.perf_counter() - started)
