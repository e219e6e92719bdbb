"""One worker process: it opens every configured dataset, then builds the batches the pool
asks for into shared memory, one at a time, answering each Task over its pipe (see
pool/messages.py), and the parts of batches (a Part: rows of a batch the pool laid out, into
the pool's segment; see pool/parts.py). Single-threaded, apart from the storage's prefetch
threads.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing.connection as mpc
import os
import re
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..formats._lake import LakeError, split_variant
from ..formats.samples import SampleError
from ..order.fingerprint import Fingerprint, fingerprint
from ..order.sampling import Ordering
from ..sources import DataChanged, StorageUnavailable, prefix_cache, split_source
from . import depth, malloc, shm, tracebacks
from . import messages as msg
from .batch import BatchTooLarge, Misfit, build_batch, build_part, build_sources, probe_fields

if TYPE_CHECKING:
    from ..formats import DatasetParts

log = logging.getLogger("stoker.server")

# Seconds a build may take for the worker to hold its result until the next one is built too
# (one pipe write for both): past it, a result goes at once, and the front end learns of a
# slow batch as soon as it is ready.
HOLD = 0.001


def worker_main(config: Any, conn: mpc.Connection, probe: bool, log_level: int,
                progress: Any = None, slot: int = 0, cache_counts: Any = None) -> None:
    """The worker process's body; `probe`: describe every dataset in the Opened message;
    `progress`: shared int64 [task id, sample] this worker is at, for the pool's watchdog;
    `slot`: its place in the pool, for its name in `ps`; `cache_counts`: the slot's shared
    int64 [hits, misses, bytes fetched] of the disk cache, which /metrics reads."""
    _name_process(slot, list(config.datasets))
    malloc.keep_freed_memory()  # a sample's freed temporaries serve the next one
    # The parent owns shutdown and closes our pipe when it is time (or dies, and the pipe ends).
    # Ctrl-C, or a SIGTERM sent to the whole process group, must not kill us mid-batch first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Spawned: nothing of the server's logging setup came along. Same level, same stream.
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[worker]: %(message)s")
    from ..formats import DatasetParts, open_dataset
    from ..formats._lake_config import LakeDataset

    cache = None
    if any(str(getattr(c, "source", "")).startswith("s3://") or isinstance(c, LakeDataset)
           for c in config.datasets.values()):
        from ..sources.cache import DiskCache

        cache = DiskCache(config.cache.dir, int(config.cache.max_bytes), counts=cache_counts)
    prefixes = prefix_cache.open_for_worker(config.cache)  # None: not configured
    datasets: dict[str, DatasetParts] = {}
    meta: dict[str, msg.DatasetMeta] = {}
    prints: dict[str, Fingerprint] = {}
    for name in opening_order(config):
        try:
            datasets[name] = ds = DatasetParts.of(open_dataset(name, config, cache, datasets))
            # Before the probe, which only this worker makes: every worker's view is of
            # the same steps.
            prints[name] = fingerprint(config.datasets[name], ds)
            if prefixes is not None and ds.use_prefix_cache is not None:
                ds.use_prefix_cache(prefixes.scope(prints[name].digest))
            if probe:
                meta[name] = describe(name, ds, config, prints[name], meta)
        except Exception as e:
            # The user's traceback (their factory, their module's import) in the server's
            # log; the server's one-line error names the dataset and the exception.
            if (tb := tracebacks.user_traceback(e)):
                log.error("dataset %r did not open:\n%s", name, tb)
            conn.send(msg.OpenFailed(f"dataset {name!r}: {type(e).__name__}: {e}"))
            return
    in_config_order = {n: meta[n] for n in config.datasets if n in meta}
    conn.send(msg.Opened(in_config_order if probe else None, prints))
    builder = _Builder(config, datasets, progress, cache, prefixes)
    # The datasets opened live as long as this worker (a list of a million file names, say):
    # the cyclic collector leaves them out of its passes from now on.
    gc.freeze()
    while True:
        try:
            received = conn.recv()
        except (EOFError, OSError):
            return
        # The pool sends what it has for this worker in one pipe write: a tuple, in order.
        # Results go back together too (one write, one wake-up of the front end) while
        # holding them costs little: a result waits at most for builds as quick as HOLD.
        held: list[Result] = []
        for message in received if isinstance(received, tuple) else (received,):
            match message:
                case msg.Task() | msg.Part():
                    started = time.monotonic()
                    held.append(builder.build(message) if isinstance(message, msg.Task)
                                else builder.build_part(message))
                    if time.monotonic() - started > HOLD:  # the next may be as slow
                        _send_results(conn, held)
                case msg.GiveBack(segments):  # the front end has sent these: reuse them
                    for segment in segments:
                        builder.segments.give_back(segment)
                case msg.Discard(segments):  # a client may still read these: never rewrite
                    for segment in segments:
                        builder.segments.discard(segment)
                case msg.Stop():
                    _send_results(conn, held)
                    return
                case _:
                    raise TypeError(f"a worker cannot handle {message!r}")
        _send_results(conn, held)


Result = msg.Built | msg.BuildFailed | msg.PartBuilt | msg.Misfit


def _send_results(conn: mpc.Connection, held: list[Result]) -> None:
    """Send the results held, in one pipe write, and forget them."""
    if held:
        conn.send(held[0] if len(held) == 1 else tuple(held))
        held.clear()


def opening_order(config: Any) -> list[str]:
    """The config's datasets, mixtures after the datasets they draw from (which they share).
    Lake tables are not among them: each snapshot a job reads opens when its first batch is
    asked for (`_Builder.dataset`; server/front/tables.py)."""
    from ..formats._lake_config import LakeDataset

    names = [n for n, c in config.datasets.items() if not isinstance(c, LakeDataset)]
    return ([n for n in names if not config.datasets[n].draws_from]
            + [n for n in names if config.datasets[n].draws_from])


def describe(name: str, ds: DatasetParts, config: Any, fp: Fingerprint,
             described: dict[str, msg.DatasetMeta]) -> msg.DatasetMeta:
    """What a probe learns of dataset `name` (DatasetMeta): `described`, the datasets before
    it in opening_order (a mixture's components)."""
    cfg = config.datasets[name]
    if cfg.draws_from:  # a mixture
        from ..formats import DrawnFrom

        drawn = ds.dataset
        assert isinstance(drawn, DrawnFrom), f"{name}: draws_from, not DrawnFrom"
        ordering: Any = drawn.ordering([described[c].ordering for c in cfg.draws_from])
        return msg.DatasetMeta(ordering.num_samples, probe_fields(ds), ordering, fp,
                               drawn.lengths([described[c].lengths for c in drawn.names]),
                               ds.prefetches)
    ordering = Ordering(len(ds.dataset), ds.shard_starts,
                        getattr(cfg, "shuffle", "global") == "block",
                        getattr(cfg, "shuffle_window", 1))
    lengths = (None if ds.sample_lengths is None
               else np.asarray(ds.sample_lengths(), dtype=np.int64))
    if lengths is not None and lengths.shape != (len(ds.dataset),):
        raise ValueError(f"sample_lengths() gave {lengths.shape[0] if lengths.ndim else 0} "
                         f"lengths for {len(ds.dataset)} samples")
    return msg.DatasetMeta(len(ds.dataset), probe_fields(ds), ordering, fp, lengths,
                           ds.prefetches)


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
    """Builds batches into this worker's segments."""

    def __init__(self, config: Any, datasets: dict[str, DatasetParts],
                 progress: Any = None, cache: Any = None, prefixes: Any = None) -> None:
        self.config = config
        self.cache, self.prefixes = cache, prefixes  # for the lake snapshots opened later
        self.progress = progress  # [task id, sample]: two stores per sample, no lock
        self.datasets = datasets
        self.segments = shm.SegmentPool(shm.worker_prefix(os.getppid(), os.getpid()),
                                         depth.KEEP_SEGMENTS, depth.KEEP_MIN, depth.KEEP_BYTES)
        self.shm_warned = False
        self.redact = _Redact(config)
        self._logged: set[str] = set()  # failure messages logged in full
        self.mappings = shm.ReadMappings(writable=True)  # of the pool's segments (parts)
        # Threads a sample-threaded dataset's batch is fetched with: the cores the workers
        # leave, shared out (one per worker once there are as many workers as cores).
        self.spare = max(1, len(os.sched_getaffinity(0)) // config.server.worker_count)

    def dataset(self, name: str) -> DatasetParts:
        """The dataset the pool names `name`: one opened at start, or a lake table's snapshot
        ("events@123"), opened here on its first batch (raises LakeError if it cannot be)."""
        ds = self.datasets.get(name)
        if ds is not None:
            return ds
        from ..formats import DatasetParts, open_dataset

        base, snapshot = split_variant(name)
        cfg = self.config.datasets[base].at_snapshot(snapshot)
        ds = DatasetParts.of(open_dataset(base, self.config, self.cache, cfg=cfg))
        if self.prefixes is not None and ds.use_prefix_cache is not None:
            ds.use_prefix_cache(self.prefixes.scope(fingerprint(cfg, ds).digest))
        self.datasets[name] = ds
        return ds

    def base(self, name: str) -> Any:
        """The config of the dataset the pool names `name`."""
        return self.config.datasets.get(name) or self.config.datasets[split_variant(name)[0]]

    def _threads(self, ds: DatasetParts) -> int:
        return self.spare if getattr(ds.dataset, "threaded_samples", False) else 1

    def _start(self, task: msg.Task | msg.Part) -> tuple[Any, str]:
        """Before a task or a part: the pool's watchdog learns which it is on, its storage is
        asked for what it reads. Returns (the callback to call per sample, or None; why the
        batch cannot be built as listed, or "")."""
        on_sample = None
        if self.progress is not None:
            progress = self.progress
            progress[0], progress[1] = task.task_id, -1  # -1: before its first sample

            def on_sample(i: int) -> None:
                progress[1] = i
        ds = self.dataset(task.dataset)
        # This batch's objects in parallel, then those of a batch further on: a store's
        # first-byte latency is paid ahead of time, not once per sample in turn.
        _prefetch(ds, task.indices)
        _prefetch(ds, task.ahead)
        if ds.read_ahead is not None:
            try:
                ds.read_ahead(task.indices)
            except Exception as e:  # each sample reads alone, and says why it cannot
                log.debug("read_ahead failed: %s", e)
        return on_sample, _changed(ds, task.indices)

    def build(self, task: msg.Task) -> msg.Built | msg.BuildFailed:
        try:
            ds = self.dataset(task.dataset)
        except Exception as e:
            return self._failure(task, e)
        skip = self.base(task.dataset).on_error == "skip"
        on_sample, changed = self._start(task)
        if changed:
            return self._failed(task, msg.FailureKind.DATA_LOSS,
                                f"dataset {task.dataset!r}: {changed}")
        try:
            if task.sources:
                return msg.Built(task.task_id, build_sources(ds, task.indices, self.segments))
            batch = build_batch(ds, task.indices, self.segments, task.key, skip,
                                int(self.config.server.max_batch_bytes), on_sample,
                                self._threads(ds))
        except Exception as e:
            return self._failure(task, e)
        return msg.Built(task.task_id, batch)

    def build_part(self, part: msg.Part) -> msg.PartBuilt | msg.BuildFailed | msg.Misfit:
        """Rows of a batch into the pool's segment. Files changed since the listing: a
        Misfit (the batch's one-worker build names the first sample that reads one)."""
        try:
            ds = self.dataset(part.dataset)
        except Exception as e:
            return self._failure(part, e)
        skip = self.base(part.dataset).on_error == "skip"
        on_sample, changed = self._start(part)
        if changed:
            return msg.Misfit(part.task_id)
        started = time.perf_counter()
        try:
            segment = self.mappings.get(part.segment, part.size)
            skipped = build_part(ds, part.layout, part.first, part.indices, segment, part.key,
                                 skip, on_sample, self._threads(ds))
        except Misfit:
            return msg.Misfit(part.task_id)
        except Exception as e:
            return self._failure(part, e)
        return msg.PartBuilt(part.task_id, skipped, time.perf_counter() - started)

    def _failure(self, task: msg.Task | msg.Part, error: Exception) -> msg.BuildFailed:
        """A build that raised `error`, as the client is told of it."""
        dataset = f"dataset {task.dataset!r}"
        match error:
            case LakeError(code="UNAVAILABLE") | StorageUnavailable():
                # an outage, not bad data: the client asks elsewhere
                return self._failed(task, msg.FailureKind.UNAVAILABLE,
                                    f"{dataset}: {error}; another server may succeed")
            case LakeError():  # a snapshot gone, a data file missing: named
                return self._failed(task, msg.FailureKind.DATA_LOSS, f"{dataset}: {error}")
            case SampleError():  # its cause: the user's exception, where it is theirs
                return self._failed(task, msg.FailureKind.DATA_LOSS, f"{dataset}: {error}",
                                    error.__cause__)
            case BatchTooLarge():
                return self._failed(task, msg.FailureKind.RESOURCE_EXHAUSTED,
                                    f"{dataset}: {error}")
            case shm.ShmFull():  # this worker lives on; later, or elsewhere, it may fit
                kind = (msg.FailureKind.RESOURCE_EXHAUSTED if error.larger_than_all
                        else msg.FailureKind.UNAVAILABLE)
                if not self.shm_warned:  # once per worker: the clients get every one
                    self.shm_warned = True
                    log.warning("a batch found no room in shared memory: %s", error)
                return self._failed(task, kind, f"{dataset}: {error}")
        log.error("a batch of dataset %r failed", task.dataset, exc_info=error)
        return self._failed(task, msg.FailureKind.INTERNAL, f"{type(error).__name__}: {error}",
                            error)

    def _failed(self, task: msg.Task | msg.Part, kind: msg.FailureKind, message: str,
                error: BaseException | None = None) -> msg.BuildFailed:
        """The failure as the client sees it: no absolute server path in it, and, for a
        dataset running the user's code (`format: python`, `transform:`), the traceback of
        `error` from their code on. The front end logs the full text (`detail`) for the
        failures it warns about; an UNAVAILABLE one is logged here, once per message."""
        cfg = self.base(task.dataset)
        # A mixture runs its components' code.
        own = [self.config.datasets[c] for c in cfg.draws_from] or [cfg]
        users = any(c.runs_user_code for c in own)
        tb = tracebacks.user_traceback(error) if error is not None and users else ""
        shown = self.redact.apply(task.dataset, message)
        if tb:
            shown += (f"\n\n{tracebacks.HEADER}\n"
                      + self.redact.apply(task.dataset, tracebacks.for_client(tb)))
        if (kind == msg.FailureKind.UNAVAILABLE and shown != message
                and message not in self._logged):
            if len(self._logged) < 4096:
                self._logged.add(message)
            log.warning("batch failed: %s", message)
        return msg.BuildFailed(task.task_id, kind, shown, message + (f"\n{tb}" if tb else ""))


def _name_process(slot: int, datasets: list[str]) -> None:
    """Name this worker in `ps` and `top` (else an anonymous multiprocessing.spawn line):
    `stoker worker 3 (server 1234): faces, mine` where setproctitle is installed (the
    server extra has it), and `stoker worker 3` as the process name (comm) in any case."""
    served = ", ".join(datasets)
    title = f"stoker worker {slot} (server {os.getppid()}): " + (
        served if len(served) <= 200 else served[:200] + "...")
    short = f"stoker worker {slot}" if slot < 10 else f"stoker-w{slot}"  # comm: 15 bytes
    try:
        import setproctitle

        setproctitle.setproctitle(title)
        setproctitle.setthreadtitle(short)
        return
    except ImportError:
        pass
    try:  # Linux: prctl(PR_SET_NAME) names the process (comm) without the package
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, short.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # another OS: the process keeps the interpreter's name


class _Redact:
    """Takes server paths out of messages for clients: a dataset's root (as configured,
    absolute, resolved; an s3:// URL, and the endpoint's URL for it) becomes nothing, so
    that a file is named by its key, relative to the root; a bare root becomes
    "<dataset root>" and the cache folder "<cache>". A client need not know where the server
    keeps its data, and may not."""

    def __init__(self, config: Any) -> None:
        cache = _spellings(str(config.cache.dir))
        self.rules: dict[str, list[tuple[re.Pattern[str], str]]] = {}
        for name, cfg in config.datasets.items():
            source = getattr(cfg, "source", None)
            roots = _spellings(split_source(str(source))[0]) if source else []
            if roots and roots[0].startswith("s3://") and config.s3_for(name).endpoint_url:
                # botocore's errors name the request's URL: endpoint/bucket/prefix/key.
                endpoint = config.s3_for(name).endpoint_url.rstrip("/")
                roots.append(f"{endpoint}/{roots[0].removeprefix('s3://')}")
            found = [(r, "") for r in roots] + [(c, "<cache>/") for c in cache]
            rules = []
            # Longest first: a cache inside the data's folder, or the data inside the cache's.
            for spelling, relative in sorted(found, key=lambda f: -len(f[0])):
                bare = "<cache>" if relative else "<dataset root>"
                rules.append((re.compile(re.escape(spelling) + "/+"), relative))
                rules.append((re.compile(re.escape(spelling) + r"(?![\w.-])"), bare))
            self.rules[name] = rules
        for name, cfg in config.datasets.items():  # a mixture's messages name its components'
            if cfg.draws_from:
                self.rules[name] = [r for c in cfg.draws_from for r in self.rules[c]]

    def apply(self, dataset: str, message: str) -> str:
        rules = self.rules.get(dataset)
        if rules is None:  # a lake table's snapshot: its table's rules
            rules = self.rules.get(split_variant(dataset)[0], [])
        for pattern, replacement in rules:
            message = pattern.sub(replacement, message)
        return message


def _spellings(root: str) -> list[str]:
    """The ways a root path may appear in a message: as configured, absolute, resolved."""
    if "://" in root:
        return [root.rstrip("/")]
    found = {root.rstrip("/"), os.path.abspath(root), os.path.realpath(root)}
    return [r for r in found if r not in ("", ".", "/")]
