"""One worker process: it opens every configured dataset, then builds the batches the pool
asks for into shared memory, one at a time, answering each Task over its pipe (see
_messages.py). Single-threaded, apart from the storage's prefetch threads.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection as mpc
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _messages as msg
from . import _shm
from ._batch import BatchTooLarge, SampleError, build_batch, probe_fields
from ._fingerprint import Fingerprint, fingerprint
from ._sampling import Ordering
from .sources import DataChanged

if TYPE_CHECKING:
    from .formats import DatasetParts

log = logging.getLogger("stoker.server")


def worker_main(config: Any, conn: mpc.Connection, probe: bool, log_level: int) -> None:
    """The worker process's body; `probe`: describe every dataset in the Opened message."""
    # The parent owns shutdown and closes our pipe when it is time (or dies, and the pipe ends).
    # Ctrl-C, or a SIGTERM sent to the whole process group, must not kill us mid-batch first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Spawned: nothing of the server's logging setup came along. Same level, same stream.
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[worker]: %(message)s")
    from .formats import DatasetParts, open_dataset

    cache = None
    if any(str(getattr(c, "source", "")).startswith("s3://") for c in config.datasets.values()):
        from .sources.cache import DiskCache

        cache = DiskCache(config.cache.dir, int(config.cache.max_bytes))
    datasets: dict[str, DatasetParts] = {}
    meta: dict[str, msg.DatasetMeta] = {}
    prints: dict[str, Fingerprint] = {}
    for name in config.datasets:
        try:
            datasets[name] = ds = DatasetParts.of(open_dataset(name, config, cache))
            # Before the probe, which only this worker makes: every worker's view is of
            # the same steps.
            prints[name] = fingerprint(config.datasets[name], ds)
            if probe:
                meta[name] = _describe(ds, config.datasets[name], prints[name])
        except Exception as e:
            conn.send(msg.OpenFailed(f"dataset {name!r}: {type(e).__name__}: {e}"))
            return
    conn.send(msg.Opened(meta if probe else None, prints))
    builder = _Builder(config, datasets, cache)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        match message:
            case msg.Task():
                conn.send(builder.build(message))
            case msg.GiveBack(segments):  # the front end has sent these batches: reuse them
                for segment in segments:
                    builder.segments.give_back(segment)
            case msg.Discard(segments):  # a client may still read these: never write them again
                for segment in segments:
                    builder.segments.discard(segment)
            case msg.Stop():
                return
            case _:
                raise TypeError(f"a worker cannot handle {message!r}")


def _describe(ds: DatasetParts, cfg: Any, fp: Fingerprint) -> msg.DatasetMeta:
    ordering = Ordering(len(ds.dataset), ds.shard_starts,
                        getattr(cfg, "shuffle", "global") == "block",
                        getattr(cfg, "shuffle_window", 1))
    return msg.DatasetMeta(len(ds.dataset), probe_fields(ds), ordering, fp)


def _changed(ds: DatasetParts, indices: np.ndarray) -> str:
    """If a file these samples read changed since the dataset was listed, why, naming the
    batch's first sample that reads it; else "". One stat per distinct file: memory-mapped
    formats read a file as it is now, so the check is here, before the batch, not in a read."""
    if ds.objects_of is None or ds.storage is None or not len(indices):
        return ""
    try:
        ds.storage.verify(ds.objects_of(indices))
    except DataChanged as e:
        first = next((int(i) for i in indices.tolist()
                      if e.key in ds.objects_of(np.array([i], np.int64))), None)
        return f"sample {first}: {e}" if first is not None else str(e)
    except OSError as e:  # a file that cannot even be looked at: the batch fails, saying why
        return str(e)
    return ""


def _prefetch(ds: DatasetParts, indices: np.ndarray) -> None:
    """Ask the dataset's storage to fetch what these samples read (a hint, never fails)."""
    try:
        ds.prefetch(indices)
    except Exception as e:  # the read itself will fail, and say why
        log.debug("prefetch hint failed: %s", e)


class _Builder:
    """Builds batches into this worker's segments; counts what its disk cache did."""

    def __init__(self, config: Any, datasets: dict[str, DatasetParts], cache: Any) -> None:
        self.config = config
        self.datasets = datasets
        self.cache = cache
        self.segments = _shm.SegmentPool(_shm.worker_prefix(os.getppid(), os.getpid()),
                                         msg.KEEP_SEGMENTS)
        self.reported = (0, 0, 0)  # the cache's counters as of the last batch sent

    def build(self, task: msg.Task) -> msg.Built | msg.BuildFailed:
        ds = self.datasets[task.dataset]
        skip = self.config.datasets[task.dataset].on_error == "skip"
        # This batch's objects in parallel, then those of a batch further on: a store's
        # first-byte latency is paid ahead of time, not once per sample in turn.
        _prefetch(ds, task.indices)
        _prefetch(ds, task.ahead)
        changed = _changed(ds, task.indices)
        if changed:
            return msg.BuildFailed(task.task_id, msg.FailureKind.DATA_LOSS,
                                   f"dataset {task.dataset!r}: {changed}")
        try:
            batch = build_batch(ds, task.indices, self.segments, task.key, skip,
                                int(self.config.server.max_batch_bytes))
        except SampleError as e:
            return msg.BuildFailed(task.task_id, msg.FailureKind.DATA_LOSS,
                               f"dataset {task.dataset!r}: {e}")
        except BatchTooLarge as e:
            return msg.BuildFailed(task.task_id, msg.FailureKind.RESOURCE_EXHAUSTED,
                               f"dataset {task.dataset!r}: {e}")
        except Exception as e:
            return msg.BuildFailed(task.task_id, msg.FailureKind.INTERNAL,
                                   f"{type(e).__name__}: {e}")
        if self.cache is not None:  # what the cache did since the last batch, for /metrics
            now = (self.cache.hits, self.cache.misses, self.cache.bytes_fetched)
            batch = dataclasses.replace(
                batch, cache=tuple(a - b for a, b in zip(now, self.reported, strict=True)))
            self.reported = now
        return msg.Built(task.task_id, batch)
