"""What the lake formats (`iceberg`, `delta`, `lance`) share: how a reader reaches storage
(`Access`), the error that names table and snapshot (`LakeError`), the library import that
names the extra, and `Files`: a snapshot's parquet data files read as format parquet reads
files, with its deleted rows left out.

A snapshot's samples: its data files in the order the table lists them, rows in file order,
deleted rows left out; sample i is the i-th row of that scan. Each dataset is opened at one
snapshot (`snapshot`: its exact id, a string) and never moves: a job on another snapshot is
served by another opening of the dataset (server/front/tables.py).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import numpy as np

from ..order.sampling import EpochKey
from ..sources import Storage
from ._contract import Sampled

# A dataset's name at one snapshot, as the server's pool and workers know it: "events@123".
VARIANT = "@"


def variant(name: str, snapshot: str) -> str:
    return f"{name}{VARIANT}{snapshot}"


def split_variant(name: str) -> tuple[str, str]:
    """"events@123" -> ("events", "123")."""
    base, _, snapshot = name.rpartition(VARIANT)
    return base, snapshot


class LakeError(ValueError):
    """A table, snapshot or data file that cannot be read; the message names the table and
    snapshot (and the file, where one is at fault). `code`: how a client is told of it
    (a gRPC status name): NOT_FOUND (no such table or snapshot: expired, vacuumed),
    FAILED_PRECONDITION (a column the snapshot lacks, a feature not read), UNAVAILABLE (the
    catalog or store did not answer), DATA_LOSS (a data file missing or corrupt)."""

    def __init__(self, message: str, code: str = "FAILED_PRECONDITION") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Access:
    """How a lake reader reaches its data: the dataset's S3 settings, and a Storage for a
    root (local folder or s3:// URL; for s3:// through the server's disk cache)."""

    s3: Any
    open_storage: Callable[[str], Storage]


def library(cfg: Any, module: str) -> Any:
    """`module` imported, or a LakeError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise LakeError(f"format: {cfg.format} needs {cfg.library} ({e}): install stoker's "
                        "`lake` extra (pip install 'stoker[lake]')") from None


def pinned_gone(latest: Callable[[], Any], pinned: bool) -> bool:
    """Whether a pinned version that did not open is gone (or never was): the table's latest
    version opens. Else the store itself did not answer (or the table is not there)."""
    if not pinned:
        return False
    try:
        latest()
    except Exception:
        return False
    return True


def endpoint_and_region(s3: Any) -> tuple[str | None, str | None]:
    """The S3 endpoint and region the dataset's storage uses (its `s3:` settings, else what
    boto3 reads from the environment), for the lake libraries, which read S3 themselves."""
    env = os.environ
    endpoint = (getattr(s3, "endpoint_url", None) or env.get("AWS_ENDPOINT_URL_S3")
                or env.get("AWS_ENDPOINT_URL"))
    region = getattr(s3, "region", None) or env.get("AWS_REGION") or env.get(
        "AWS_DEFAULT_REGION")
    return endpoint, region


def object_store_options(s3: Any, upper: bool) -> dict[str, str]:
    """The dataset's S3 endpoint and region as delta-rs and Lance (Rust object_store) take
    them; credentials come from the environment's standard chain, as boto3's do."""
    endpoint, region = endpoint_and_region(s3)
    opts = {}
    if endpoint:
        opts["aws_endpoint"] = endpoint
        if endpoint.startswith("http://"):
            opts["aws_allow_http"] = "true"
    if region:
        opts["aws_region"] = region
    return {k.upper(): v for k, v in opts.items()} if upper else opts


def relative_key(root: str, path: str) -> str:
    """A data file's path (a URI, or relative to the table's root) as a key under `root`."""
    path = unquote(path.removeprefix("file://")) if path.startswith("file://") else path
    root = root.removeprefix("file://").rstrip("/")
    if "://" not in path and not path.startswith("/"):
        return unquote(path)
    if not path.startswith(root + "/"):
        raise LakeError(f"data file {path} lies outside the table's location {root}")
    return path[len(root) + 1:]


def check_columns(cfg: Any, schema: list[str], what: str) -> None:
    """LakeError naming each configured column the snapshot's schema lacks."""
    wanted = {f.column or name for name, f in (cfg.fields or {}).items()}
    wanted |= {f.time_column for f in (cfg.fields or {}).values() if f.time_column}
    if cfg.length_column:
        wanted.add(cfg.length_column)
    missing = sorted(wanted - set(schema))
    if missing:
        raise LakeError(f"{what}: column(s) {missing} not in the snapshot's schema; it has "
                        f"columns {schema}")


class Files(Sampled):
    """A snapshot's parquet data files (`keys` under `storage`), read by format parquet's
    reader, without the rows `deleted` (key -> positions in that file, ascending). `what`
    names the table and snapshot in every error and source. Thread-safe as Parquet is."""

    def __init__(self, cfg: Any, storage: Storage, keys: list[str], what: str,
                 snapshot: str, deleted: dict[str, np.ndarray] | None = None,
                 field_ids: dict[str, int] | None = None) -> None:
        from .parquet import Parquet  # pyarrow: not in the front end until a table opens

        self.what, self.snapshot = what, snapshot
        self.storage = storage
        try:
            self._rows = Parquet(cfg, storage, keys=keys, field_ids=field_ids)
        except (ValueError, OSError) as e:
            raise LakeError(f"{what}: {e}", "DATA_LOSS") from None
        # Physical row (across the files, in order) of each sample; None: no row deleted.
        self._kept: np.ndarray | None = None
        if deleted and any(len(v) for v in deleted.values()):
            first = dict(zip(keys, np.concatenate(
                [[0], np.cumsum(self._file_rows(keys))])[:-1].tolist(), strict=True))
            gone = np.concatenate([np.asarray(p, np.int64) + first[k]
                                   for k, p in deleted.items() if k in first] or [[]])
            self._kept = np.setdiff1d(np.arange(self._rows.length, dtype=np.int64),
                                      gone.astype(np.int64), assume_unique=False)
        self.length = self._rows.length if self._kept is None else len(self._kept)
        if self.length == 0:
            raise LakeError(f"{what}: no rows", "FAILED_PRECONDITION")
        groups = self._rows.shard_starts
        shards = (groups if self._kept is None else
                  np.unique(np.searchsorted(self._kept, groups)).astype(np.int64))
        self.shard_starts = shards[shards < self.length]
        self.sample_lengths = None if cfg.length_column is None else self._lengths

    def _file_rows(self, keys: list[str]) -> list[int]:
        p = self._rows
        per_file = np.bincount(p.group_file, weights=np.diff(p.groups.starts),
                               minlength=len(keys))
        return per_file.astype(np.int64).tolist()

    def _row(self, index: int) -> int:
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} not in [0, {self.length})")
        return index if self._kept is None else int(self._kept[index])

    def _rows_of(self, indices: np.ndarray) -> np.ndarray:
        return indices if self._kept is None else self._kept[indices]

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        return self._rows.sample(self._row(index), key)

    def _lengths(self) -> np.ndarray:
        lengths = self._rows._lengths()
        return lengths if self._kept is None else lengths[self._kept]

    def use_prefix_cache(self, scope: Any) -> None:
        self._rows.use_prefix_cache(scope)

    def source_of(self, index: int) -> str:
        return f"{self.what}: {self._rows.source_of(self._row(index))}"

    def place_of(self, index: int) -> dict[str, Any]:
        return self._rows.place_of(self._row(index))

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return self._rows.objects_of(self._rows_of(np.asarray(indices, np.int64)))
