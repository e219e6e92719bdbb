"""`format: parquet`: columns of Parquet files (pyarrow), read one row group at a time.

A field is a column of numbers (bool, int, uint, float) or of lists of them, fixed-size or
not, nested or not. A row group's columns are converted to numpy once, as dense arrays
[rows, *shape]: the rows of a list column must have one length within each row group (and,
for a batch to form, across the row groups a batch draws from). Each process keeps one decoded
row group: block shuffle (the default) reads a row group's rows together, so this costs one
decode per row group and window; `shuffle: global` may decode a row group per sample.

At open only the footers are read (for s3:// sources that fetches every file into the disk
cache). A missing column or one of another type stops the server at open. A null, or a value
that does not fit the field's `dtype`, fails that row's sample when it is read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..sources import Storage
from ._shards import ShardIndex
from .memmap import OpenMaps

DEFAULT_PATTERN = "**/*.parquet"  # a source that names a directory: every .parquet under it


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _leaf(t: pa.DataType) -> pa.DataType:
    while _is_list(t):
        t = t.value_type
    return t


def _number(t: pa.DataType) -> bool:
    return pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t)


class Ragged(ValueError):
    pass


def dense(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A column of n rows -> values [n, *shape] and ok [n] (False: the row holds a null;
    its values are zeros). Raises Ragged when list rows differ in length."""
    n = len(arr)
    if arr.null_count:
        ok = arr.is_valid().to_numpy(zero_copy_only=False)
        values, inner_ok = dense(arr.filter(pa.array(ok)))
        out = np.zeros((n, *values.shape[1:]), values.dtype)
        out[ok] = values
        rows_ok = ok.copy()
        rows_ok[ok] = inner_ok
        return out, rows_ok
    if _is_list(arr.type):
        if pa.types.is_fixed_size_list(arr.type):
            width = arr.type.list_size
        else:
            lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
            if n and lengths.min() != lengths.max():
                raise Ragged(f"list rows have lengths {lengths.min()} to {lengths.max()}; "
                             "a field needs one length")
            width = int(lengths[0]) if n else 0
        values, inner_ok = dense(arr.flatten())
        return (values.reshape(n, width, *values.shape[1:]),
                inner_ok.reshape(n, width).all(axis=1))
    return arr.to_numpy(zero_copy_only=False), np.ones(n, dtype=bool)


class _Column:
    """One field of one decoded row group."""

    def __init__(self, values: np.ndarray, ok: np.ndarray, fits: np.ndarray) -> None:
        self.values, self.ok, self.fits = values, ok, fits


class Parquet:
    """Thread-safe: the decoded row group is replaced as a whole, never changed in place."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        self.storage = storage
        self.fields = {name: (f.column or name, np.dtype(f.dtype) if f.dtype else None)
                       for name, f in cfg.fields.items()}
        self.columns = sorted({col for col, _ in self.fields.values()})
        infos = storage.list(pattern or DEFAULT_PATTERN)
        if not infos:
            raise ValueError(f"{storage.url}: no files match {pattern or DEFAULT_PATTERN!r}")
        types: dict[str, tuple[pa.DataType, str]] = {}  # column -> type, first file with it
        group_file, group_index, group_rows = [], [], []
        for f, o in enumerate(infos):
            where = storage.where(o.key)
            try:
                with pq.ParquetFile(storage.local_path(o.key)) as pf:
                    schema, meta = pf.schema_arrow, pf.metadata
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{where}: not a readable Parquet file: {e}") from None
            for name, (col, dtype) in self.fields.items():
                self._check(where, schema, name, col, dtype, types)
            for g in range(meta.num_row_groups):
                group_file.append(f)
                group_index.append(g)
                group_rows.append(meta.row_group(g).num_rows)
        # Fixed-width numpy arrays, not lists of str: nothing for copy-on-write to touch.
        self.keys = np.array([o.key for o in infos])
        self.group_file = np.array(group_file, dtype=np.int64)
        self.group_index = np.array(group_index, dtype=np.int64)
        self.groups = ShardIndex(group_rows)
        self.length = self.groups.length
        if self.length == 0:
            raise ValueError(f"{storage.url}: no rows in {len(infos)} files")
        self.shard_starts = self.groups.shard_starts
        self._files: OpenMaps[pq.ParquetFile] = OpenMaps(
            storage, lambda key, path: pq.ParquetFile(path), limit=16)
        self._decoded: tuple[int, dict[str, _Column] | str] = (-1, {})

    def _check(self, where: str, schema: pa.Schema, name: str, col: str,
               dtype: np.dtype | None, types: dict[str, tuple[pa.DataType, str]]) -> None:
        if col not in schema.names:
            raise ValueError(f"{where}: field {name!r}: no column {col!r}; the file has "
                             f"columns {schema.names}")
        t = schema.field(col).type
        if not _number(_leaf(t)):
            raise ValueError(f"{where}: field {name!r}: column {col!r} is {t}; a field needs "
                             "numbers (bool, int, uint, float) or lists of them")
        first = types.setdefault(col, (t, where))
        if dtype is None and first[0] != t:
            raise ValueError(f"{where}: field {name!r}: column {col!r} is {t}, but {first[0]} "
                             f"in {first[1]}; set the field's dtype")

    def _decode(self, g: int) -> dict[str, _Column] | str:
        """Row group g's fields as numpy, or why it cannot be decoded."""
        key = str(self.keys[self.group_file[g]])
        try:
            table = self._files.get(key).read_row_group(
                int(self.group_index[g]), columns=self.columns, use_threads=False)
        except (pa.ArrowException, OSError) as e:
            return f"cannot read the row group: {type(e).__name__}: {e}"
        decoded = {}
        for name, (col, dtype) in self.fields.items():
            try:
                values, ok = dense(table.column(col).combine_chunks())
            except Ragged as e:
                return f"field {name!r}: column {col!r}: {e}"
            fits = np.ones(len(ok), dtype=bool)
            if dtype is not None and dtype != values.dtype:
                with np.errstate(all="ignore"):  # checked below instead
                    cast = values.astype(dtype)
                if dtype.kind in "biu":  # integers must survive the cast exactly
                    same = (cast == values).reshape(len(ok), -1).all(axis=1)
                    fits = same | ~ok
                values = cast
            decoded[name] = _Column(values, ok, fits)
        return decoded

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        g, row = self.groups.locate(index)
        cached_g, decoded = self._decoded
        if cached_g != g:
            decoded = self._decode(g)
            self._decoded = (g, decoded)  # one row group per process: block shuffle's unit
        if isinstance(decoded, str):
            raise ValueError(decoded)
        out = {}
        for name, column in decoded.items():
            col, dtype = self.fields[name]
            if not column.ok[row]:
                raise ValueError(f"field {name!r}: column {col!r} holds a null")
            if not column.fits[row]:
                raise ValueError(f"field {name!r}: column {col!r}: a value does not fit {dtype}")
            out[name] = column.values[row].copy()  # a copy: the row group is dropped later
        return out

    def source_of(self, index: int) -> str:
        g, row = self.groups.locate(index)
        key = str(self.keys[self.group_file[g]])
        return f"{self.storage.where(key)} row group {int(self.group_index[g])} row {row}"

    def objects_of(self, indices: np.ndarray) -> list[str]:
        groups = self.groups.shards_of(indices)
        return self.keys[np.unique(self.group_file[groups])].tolist()
