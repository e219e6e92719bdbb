"""Lake tables' snapshots as the front end serves them: which snapshot a job reads, and its
opening (`Tables`).

A lake dataset (format iceberg, delta, lance) is not opened when the server starts: a job
names the snapshot it reads in its coordinates (`Coordinates.snapshot`). A new job names none:
its first Describe resolves the config's pin, else the table's current snapshot, and the
reply's fingerprint carries it; the job sends it from then on, and a resumed job sends the
one its state_dict recorded. Each snapshot asked for is opened once, by time travel, even
after the table has moved on; as "events@<snapshot>" it is a dataset of its own to the pool
and its workers (each worker opens it when its first batch comes, formats/_lake.py).

A server whose config pins a snapshot refuses a job on another (FAILED_PRECONDITION, naming
both); a snapshot that is gone (expired, vacuumed) is NOT_FOUND; a catalog or store that does
not answer is UNAVAILABLE (the client asks another server, or again). Each names the table
and the snapshot; other datasets are served on meanwhile.

Threading: every method runs on the server's asyncio loop; opening runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import grpc

from ..formats._lake import LakeError, split_variant, variant
from ..formats._lake_config import LakeDataset
from ..pool.messages import DatasetMeta
from .refusal import Abort

log = logging.getLogger("stoker.server")

# Seconds a Describe waits for its snapshot to open before it is answered UNAVAILABLE (the
# opening goes on): well under a client's per-call deadline (10 s).
OPEN_WAIT = 4.0


def _abort(e: LakeError) -> Abort:
    """A snapshot that does not open, as its Describe or stream is answered: a data file
    missing or corrupt is FAILED_PRECONDITION here (every server would say the same; the
    client must not retry), DATA_LOSS only for a batch's samples."""
    code = "FAILED_PRECONDITION" if e.code == "DATA_LOSS" else e.code
    return Abort(getattr(grpc.StatusCode, code, grpc.StatusCode.FAILED_PRECONDITION), str(e))


class Tables:
    """The config's lake datasets: each one's snapshots opened here (name -> snapshot ->
    DatasetMeta), the snapshot a new job gets (`current`), and the openings under way."""

    def __init__(self, config: Any,
                 on_open: Callable[[str, DatasetMeta], None] = lambda name, meta: None
                 ) -> None:
        self._config = config
        self._on_open = on_open  # told of each snapshot opened, by its pool name
        self.names = {n for n, c in config.datasets.items() if isinstance(c, LakeDataset)}
        self._opened: dict[str, dict[str, DatasetMeta]] = {n: {} for n in self.names}
        self.current: dict[str, str] = {}
        self._opening: dict[tuple[str, str], asyncio.Future[DatasetMeta]] = {}
        self._failed: dict[tuple[str, str], LakeError] = {}
        self._settling: set[asyncio.Future[None]] = set()  # resolutions under way
        self._cache: Any = None

    # -- what the service asks ----------------------------------------------------------------
    def metas(self) -> dict[str, DatasetMeta]:
        """Each lake dataset at the snapshot a new job would get now (those opened)."""
        return {n: self._opened[n][s] for n, s in self.current.items() if s in self._opened[n]}

    def meta_of(self, dataset: str) -> DatasetMeta | None:
        """A pool dataset name ("events@123") -> its meta, if it is one of these."""
        base, snapshot = split_variant(dataset)
        return self._opened.get(base, {}).get(snapshot)

    async def prepare(self, name: str, wanted: str) -> None:
        """Before a Describe of `name` at snapshot `wanted` ("": a new job's): resolve it and
        open it (or raise Abort saying why not). An opening that takes longer than OPEN_WAIT
        (a library's first import, a slow catalog) goes on, and the caller is answered
        UNAVAILABLE: a client asks again, under its `timeout`, not its `connect_timeout`."""
        if name not in self.names:
            return
        task = self._keep(self._prepare(name, wanted))
        try:
            await asyncio.wait_for(asyncio.shield(task), OPEN_WAIT)
        except TimeoutError:
            raise Abort(grpc.StatusCode.UNAVAILABLE,
                        f"dataset {name!r}: opening {self._what(name)} snapshot "
                        f"{wanted or '(current)'}; ask again") from None

    async def _prepare(self, name: str, wanted: str) -> None:
        cfg = self._config.datasets[name]
        if not wanted or cfg.pinned:
            resolved = await self._resolve(name)
            if wanted and wanted != resolved:
                raise self._other(name, wanted, resolved)
            wanted = resolved
            self.current[name] = resolved
        await self._open(name, wanted)

    def lookup(self, name: str, wanted: str) -> tuple[str, DatasetMeta]:
        """The pool's name and the meta of `name` at snapshot `wanted`, opened already; else
        Abort: UNAVAILABLE while it opens (it is started here), or why it cannot be served."""
        cfg = self._config.datasets[name]
        if not wanted:
            wanted = self.current.get(name, "")
            if not wanted:
                raise Abort(grpc.StatusCode.UNAVAILABLE,
                            f"dataset {name!r}: no snapshot resolved yet: Describe it first")
        elif cfg.pinned and name not in self.current:  # what the pin means: asked first
            self._keep(self._settle_pin(name))
            raise Abort(grpc.StatusCode.UNAVAILABLE,
                        f"dataset {name!r}: resolving the snapshot its config pins; ask again")
        elif cfg.pinned and wanted != self.current[name]:
            raise self._other(name, wanted, self.current[name])
        meta = self._opened[name].get(wanted)
        if meta is not None:
            return variant(name, wanted), meta
        failed = self._failed.get((name, wanted))
        if failed is not None:
            raise _abort(failed)
        self._start_open(name, wanted)
        raise Abort(grpc.StatusCode.UNAVAILABLE,
                    f"dataset {name!r}: {self._what(name)} snapshot {wanted} is being opened "
                    "here; ask again")

    # -- resolving and opening ----------------------------------------------------------------
    def _what(self, name: str) -> str:
        cfg = self._config.datasets[name]
        return f"{cfg.format} table {getattr(cfg, 'table', None) or cfg.source}"

    def _other(self, name: str, wanted: str, pinned: str) -> Abort:
        cfg = self._config.datasets[name]
        pin = ", ".join(f"{p}: {getattr(cfg, p)}" for p in cfg.pins if getattr(cfg, p) is not None)
        return Abort(grpc.StatusCode.FAILED_PRECONDITION,
                     f"dataset {name!r}: this server serves {self._what(name)} snapshot "
                     f"{pinned} (its config pins {pin}); the job reads snapshot {wanted}: this "
                     "server does not join it (one job must not mix snapshots)")

    async def _resolve(self, name: str) -> str:
        """The snapshot the config's pin, else the table's current one, resolves to now."""
        from ..formats import FORMATS, _load

        cfg = self._config.datasets[name]
        current = _load(FORMATS[cfg.format][1].split(":")[0] + ":current")
        try:
            return str(await asyncio.to_thread(current, cfg, self._config.s3_for(name)))
        except LakeError as e:
            raise _abort(e) from None

    def _keep(self, work: Any) -> asyncio.Future[None]:
        """`work` run as a task held until it ends (its outcome read: nobody may wait)."""
        task = asyncio.ensure_future(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _settle_pin(self, name: str) -> None:
        with contextlib.suppress(Abort):
            self.current[name] = await self._resolve(name)

    def _start_open(self, name: str, snapshot: str) -> asyncio.Future[DatasetMeta]:
        key = (name, snapshot)
        if key not in self._opening:
            self._failed.pop(key, None)
            self._opening[key] = asyncio.ensure_future(asyncio.to_thread(
                self._open_here, name, snapshot))
            self._opening[key].add_done_callback(lambda f: self._opened_one(key, f))
        return self._opening[key]

    def _opened_one(self, key: tuple[str, str], future: asyncio.Future[DatasetMeta]) -> None:
        del self._opening[key]
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            self._opened[key[0]][key[1]] = future.result()
            self._on_open(variant(*key), future.result())
            log.info("dataset %r: opened %s snapshot %s", key[0], self._what(key[0]), key[1])
        elif isinstance(error, LakeError):
            if error.code != "UNAVAILABLE":  # a later ask may find the catalog up again
                self._failed[key] = error
            log.error("dataset %r: %s", key[0], error)
        else:
            self._failed[key] = LakeError(f"dataset {key[0]!r}: {self._what(key[0])} snapshot "
                                          f"{key[1]}: {type(error).__name__}: {error}",
                                          "FAILED_PRECONDITION")
            log.error("dataset %r: snapshot %s did not open", key[0], key[1], exc_info=error)

    async def _open(self, name: str, snapshot: str) -> DatasetMeta:
        if snapshot in self._opened[name]:
            return self._opened[name][snapshot]
        failed = self._failed.get((name, snapshot))
        if failed is not None:
            raise _abort(failed)
        try:
            return await asyncio.shield(self._start_open(name, snapshot))
        except LakeError as e:
            raise _abort(e) from None
        except Exception as e:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                        f"dataset {name!r}: {self._what(name)} snapshot {snapshot}: "
                        f"{type(e).__name__}: {e}") from None

    def _open_here(self, name: str, snapshot: str) -> DatasetMeta:
        """Open `name` at `snapshot` in this process, for its meta (worker 0's probe at
        start does this for every other dataset). A thread of its own."""
        from ..formats import DatasetParts, open_dataset
        from ..order.fingerprint import fingerprint
        from ..pool.worker_main import describe

        cfg = self._config.datasets[name].at_snapshot(snapshot)
        ds = DatasetParts.of(open_dataset(name, self._config, self._disk_cache(), cfg=cfg))
        if ds.snapshot != snapshot:
            raise LakeError(f"{self._what(name)}: asked for snapshot {snapshot}, opened "
                            f"{ds.snapshot}")
        return describe(name, ds, self._config, fingerprint(cfg, ds), {})

    def _disk_cache(self) -> Any:
        if self._cache is None:
            from ..sources.cache import DiskCache

            self._cache = DiskCache(self._config.cache.dir, int(self._config.cache.max_bytes))
        return self._cache
