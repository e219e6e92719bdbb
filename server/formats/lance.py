"""`format: lance`: a Lance dataset at one version, through pylance (the `lake` extra).

Rows are read by random access: sample i is row i of the version's live rows (deleted rows
left out), its columns only, decoded as format parquet decodes them; a batch's rows are read
in one `take` (`read_ahead`), a lone sample's alone. A global shuffle so costs one row per
sample, not a row group; `shuffle: block` permutes fragments.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..order.sampling import EpochKey
from ._contract import Sampled
from ._lake import Access, LakeError, check_columns, library, object_store_options, pinned_gone
from .parquet import Columns


def _open(cfg: Any, s3: Any) -> Any:
    lance = library(cfg, "lance")
    opts = object_store_options(s3, upper=False) if cfg.source.startswith("s3://") else None
    pin = cfg.version if cfg.version is not None else cfg.tag
    what = (f"version {cfg.version}" if cfg.version is not None else
            f"tag {cfg.tag!r}" if cfg.tag is not None else "latest version")
    try:
        return lance.dataset(cfg.source, version=pin, storage_options=opts)
    except Exception as e:
        gone = pinned_gone(lambda: lance.dataset(cfg.source, storage_options=opts),
                           pin is not None)
        raise LakeError(f"lance dataset {cfg.source} {what}: cannot open"
                        f"{' (removed by cleanup_old_versions, or never made)' if gone else ''}"
                        f": {type(e).__name__}: {e}", "NOT_FOUND" if gone else "UNAVAILABLE"
                        ) from None


def current(cfg: Any, s3: Any) -> str:
    """The version the config's pin, else the dataset's latest, resolves to."""
    return str(_open(cfg, s3).version)


class Lance(Sampled):
    """Thread-safe: Lance's dataset takes concurrent `take`s; nothing here changes."""

    def __init__(self, cfg: Any, access: Access) -> None:
        ds = _open(cfg, access.s3)
        self.snapshot = str(ds.version)
        self.what = f"lance dataset {cfg.source} version {ds.version}"
        schema = ds.schema
        check_columns(cfg, list(schema.names), self.what)
        self.cols = Columns(cfg.fields, None)
        for f in self.cols.fields:
            try:
                f.check(self.what, schema)
            except ValueError as e:
                raise LakeError(str(e)) from None
        self._ds = ds
        fragments = ds.get_fragments()
        counts = np.array([f.count_rows() for f in fragments], dtype=np.int64)
        self.length = int(counts.sum())
        if self.length == 0:
            raise LakeError(f"{self.what}: no rows")
        starts = np.concatenate([[0], np.cumsum(counts)])[:-1]
        self.shard_starts = np.unique(starts[counts > 0]).astype(np.int64)
        self._fragment_ids = np.array([f.fragment_id for f in fragments], dtype=np.int64)
        self._starts = starts
        self.length_column = cfg.length_column
        self.sample_lengths = None if cfg.length_column is None else self._lengths
        self._own = f"lance {ds.uri.rsplit('/', 1)[-1]} version {ds.version} rows {self.length}"
        # The rows read ahead (sorted sample indices, their decoded columns), replaced whole.
        self._ahead: tuple[np.ndarray, Any] = (np.zeros(0, np.int64), {})

    def read_ahead(self, indices: np.ndarray) -> None:
        """A batch's rows in one `take` (one read per row: no row group, and one call, not
        one per sample)."""
        rows = np.unique(np.asarray(indices, np.int64))
        rows = rows[(rows >= 0) & (rows < self.length)]
        if len(rows) < 2:
            return
        decoded = self.cols.decode(self._ds.take(rows.tolist(), columns=self.cols.names))
        if not isinstance(decoded, str):  # else each sample reads alone and says why
            self._ahead = (rows, decoded)

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} not in [0, {self.length})")
        rows, ahead = self._ahead
        at = int(np.searchsorted(rows, index))
        if at < len(rows) and rows[at] == index:
            return self.cols.row(ahead, at, index, key)
        try:
            table = self._ds.take([index], columns=self.cols.names)
        except Exception as e:
            raise LakeError(f"{self.what}: row {index}: cannot read: {type(e).__name__}: {e}",
                            "DATA_LOSS") from None
        decoded = self.cols.decode(table)
        if isinstance(decoded, str):
            raise ValueError(decoded)
        return self.cols.row(decoded, 0, index, key)

    def _lengths(self) -> np.ndarray:
        import pyarrow as pa
        import pyarrow.compute as pc

        column = self._ds.to_table(columns=[self.length_column]).column(0).combine_chunks()
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or \
                pa.types.is_fixed_size_list(column.type):
            column = pc.list_value_length(column)
        elif not pa.types.is_integer(column.type):
            raise LakeError(f"{self.what}: length_column {self.length_column!r}: column is "
                            f"{column.type}, expected integers (the length) or lists")
        return column.to_numpy(zero_copy_only=False).astype(np.int64)

    def use_prefix_cache(self, scope: Any) -> None:
        self.cols.use_prefix_cache(scope)

    def source_of(self, index: int) -> str:
        place = self.place_of(index)
        return f"{self.what} fragment {place['row_group']} row {place['row']}"

    def place_of(self, index: int) -> dict[str, Any]:
        f = int(np.searchsorted(self._starts, index, side="right") - 1)
        return {"file": self.what, "row_group": int(self._fragment_ids[f]),
                "row": int(index - self._starts[f])}

    def fingerprint(self) -> str:
        return self._own
