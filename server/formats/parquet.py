"""`format: parquet`: columns of Parquet files (pyarrow), read one row group at a time.

A field is one top-level column, either numbers (no `decode`) or decoded like a tar member:

- numbers: bool, int, uint, float, or lists of them, fixed-size or not, nested or not. A row
  group's column is converted to numpy once, as a dense array [rows, *shape]: the rows of a
  list column must have one length within each row group (and, for a batch to form, across
  the row groups a batch draws from);
- `decode: image`: encoded images (JPEG, PNG...) in a binary column, or in the `bytes` of a
  struct<bytes, path> column (what Hugging Face `datasets` writes for an `Image()` feature),
  through the image pipeline of image-folder and tar (images.py: `size`, `transforms`,
  `layout`; with neither, the native size and `<name>_size`). A row whose bytes are null (a
  `datasets` image stored only as a path) fails;
- `decode: utf8`: a string column as its UTF-8 bytes, uint8[max_bytes] zero-padded and
  `<name>_length` (jsonl's `utf8_padded`);
- `decode: tokens`: a string column tokenized (tokenizer.py, as `format: text` loads it;
  no special tokens added): int64[max_tokens], cut there, padded with `pad_id`, and
  `<name>_length`. A row group's strings are encoded in one call when it is decoded.

`length_column` (any column: integers, or lists whose lengths count) gives each row's token
count (`sample_lengths`, for token budgets), read when first asked, that column only.

Each process keeps one decoded row group: block shuffle (the default) reads a row group's rows
together, so this costs one decode per row group and window; `shuffle: global` may decode a
row group per sample. Image bytes stay encoded until their sample is read.

At open only the footers are read (for s3:// sources that fetches every file into the disk
cache). A missing column, or one whose type the field cannot take, stops the server at open,
naming the column and its Arrow type. So does a null that the footer's statistics show in a
field's column, unless the field has a `fill` (nulls become it) or the dataset has
`on_error: skip` (the row's sample is replaced when read). A null the statistics do not
show (a writer that wrote none), or a value that does not fit the field's `dtype`, fails that
row's sample when it is read.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..order.sampling import EpochKey
from ..sources import Storage
from ._contract import Sampled
from ._shards import ShardIndex
from .jsonl import utf8_padded
from .memmap import OpenMaps
from .tokenizer import load_tokenizer

DEFAULT_PATTERN = "**/*.parquet"  # a source that names a directory: every .parquet under it


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _leaf(t: pa.DataType) -> pa.DataType:
    while _is_list(t):
        t = t.value_type
    return t


def _number(t: pa.DataType) -> bool:
    return pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t)


def _string(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_large_string(t)
            or getattr(pa.types, "is_string_view", lambda _: False)(t))


def _binary(t: pa.DataType) -> bool:
    return (pa.types.is_binary(t) or pa.types.is_large_binary(t)
            or getattr(pa.types, "is_binary_view", lambda _: False)(t))


def _image_struct(t: pa.DataType) -> bool:
    """struct<bytes: binary, ...>: a Hugging Face `Image()` column."""
    return (pa.types.is_struct(t) and t.get_field_index("bytes") >= 0
            and _binary(t.field("bytes").type))


class Ragged(ValueError):
    pass


def dense(arr: pa.Array, fill: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """A column of n rows -> values [n, *shape] and ok [n] (False: the row holds a null;
    its values are zeros). With `fill`, nulls at any depth hold it and every row is ok.
    Raises Ragged when list rows differ in length."""
    n = len(arr)
    if arr.null_count:
        ok = arr.is_valid().to_numpy(zero_copy_only=False)
        values, inner_ok = dense(arr.filter(pa.array(ok)), fill)
        shape = (n, *values.shape[1:])
        out = np.zeros(shape, values.dtype) if fill is None else np.full(shape, fill,
                                                                          values.dtype)
        out[ok] = values
        rows_ok = ok.copy() if fill is None else np.ones(n, dtype=bool)
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
        values, inner_ok = dense(arr.flatten(), fill)
        return (values.reshape(n, width, *values.shape[1:]),
                np.asarray(inner_ok.reshape(n, width).all(axis=1)))
    return arr.to_numpy(zero_copy_only=False), np.ones(n, dtype=bool)


def _hub_hint(schema: pa.Schema, col: str) -> str:
    """` (a Hugging Face Image())`, when the file's `datasets` metadata says so."""
    try:
        features = json.loads((schema.metadata or {})[b"huggingface"])["info"]["features"]
        kind = features[col]["_type"]
    except (KeyError, TypeError, ValueError):
        return ""
    return f" (a Hugging Face {kind}())"


class _Field:
    """One configured field: its column, how it decodes, and its fill."""

    def __init__(self, name: str, cfg: Any) -> None:
        self.name = name
        self.col = cfg.column or name
        self.dtype = np.dtype(cfg.dtype) if cfg.dtype else None
        self.decode = cfg.decode
        self.fill = cfg.fill
        self.max_bytes = cfg.max_bytes
        self.max_tokens = cfg.max_tokens
        self.pipeline = None
        if cfg.decode == "image":  # imported here: a table of numbers needs no image codecs
            from ..images import image_pipeline

            self.pipeline = image_pipeline(cfg)
        self.frames = None  # decode: video_frames
        self.clip = None  # decode: video
        if cfg.decode == "video_frames":  # imported here: PyAV only where a field decodes video
            from .video import FramesAt

            self.frames = FramesAt(cfg)
        elif cfg.decode == "video":
            from .video import ClipOfBytes

            self.clip = ClipOfBytes(cfg)
        self.time_col = cfg.time_column
        self.tokenizer = None
        if cfg.decode == "tokens":
            self.tokenizer = load_tokenizer(cfg.tokenizer, cfg.tiktoken_pattern)
            tok = self.tokenizer
            self.pad_id = next(i for i in (cfg.pad_id, tok.pad_id, tok.eos_id, 0)
                               if i is not None)

    @property
    def outputs(self) -> list[str]:
        if self.pipeline is not None:  # native size adds <name>_size
            return self.pipeline.output_names(self.name)
        video = self.frames if self.frames is not None else self.clip
        if video is not None:
            return video.output_names(self.name)
        return [self.name] + ([f"{self.name}_length"] if self.decode in ("utf8", "tokens")
                              else [])

    def check(self, where: str, schema: pa.Schema) -> pa.DataType:
        """The column's type, or ValueError naming it when this field cannot take it."""
        if self.col not in schema.names:
            raise ValueError(f"{where}: field {self.name!r}: no column {self.col!r}; the file "
                             f"has columns {schema.names}")
        t = schema.field(self.col).type
        what = f"{where}: field {self.name!r}: column {self.col!r} is {t}"
        if self.decode is None and not _number(_leaf(t)):
            if _string(t):
                hint = "; set decode: utf8 (its bytes) or decode: tokens"
            elif _binary(t) or _image_struct(t):
                hint = "; set decode: image if it holds encoded images"
            else:
                hint = ""
            raise ValueError(f"{what}{_hub_hint(schema, self.col)}: a field without decode "
                             f"needs numbers (bool, int, uint, float) or lists of them{hint}")
        if self.decode == "video" and not _binary(t):
            raise ValueError(f"{what}: decode: video needs a binary column (video files)")
        if self.decode == "image" and not (_binary(t) or _image_struct(t)):
            raise ValueError(f"{what}: decode: image needs a binary column or a struct with "
                             "binary `bytes` (a Hugging Face Image())")
        if self.decode in ("utf8", "tokens", "video_frames") and not _string(t):
            raise ValueError(f"{what}: decode: {self.decode} needs a string column")
        if self.time_col is not None and (self.time_col not in schema.names or not _number(
                schema.field(self.time_col).type)):
            raise ValueError(f"{where}: field {self.name!r}: time_column {self.time_col!r}: "
                             f"expected a column of numbers (seconds); the file has columns "
                             f"{schema.names}")
        if self.decode is None and self.fill is not None:
            leaf = _leaf(t)
            if (pa.types.is_integer(leaf) or pa.types.is_boolean(leaf)) and not (
                    float(self.fill).is_integer()):  # NaN too
                raise ValueError(f"{what}: fill {self.fill!r} is no {leaf} value")
        return t

    def null_leaves(self, t: pa.DataType) -> tuple[str, ...]:
        """The Parquet leaf columns (paths) whose nulls are this field's nulls."""
        if _image_struct(t):  # `path` is null whenever the bytes are embedded
            return (f"{self.col}.bytes",)
        return (self.col,)  # and its nested leaves: see _null_counts


def _null_counts(meta: pq.FileMetaData, g: int) -> dict[str, int | None]:
    """Row group g's null count per leaf column path, None where no statistics say."""
    rg = meta.row_group(g)
    out = {}
    for c in range(rg.num_columns):
        col = rg.column(c)
        stats = col.statistics
        out[col.path_in_schema] = (stats.null_count if stats is not None
                                   and stats.has_null_count else None)
    return out


class _Decoded:
    """One field of one decoded row group: `values` (numpy, or a pyarrow array for image
    and utf8), `ok` (False: the row is null), `fits` (False: the row's value does not fit
    dtype); tokens: `ids` and `starts` (int64, rows + 1)."""

    def __init__(self, values: Any, ok: np.ndarray, fits: np.ndarray | None = None,
                 starts: np.ndarray | None = None) -> None:
        self.values, self.ok, self.starts = values, ok, starts
        self.fits = np.ones(len(ok), dtype=bool) if fits is None else fits


def _decode_field(field: _Field, column: pa.Array) -> _Decoded:
    if field.decode == "image":
        data = column.field("bytes") if pa.types.is_struct(column.type) else column
        ok = data.is_valid().to_numpy(zero_copy_only=False)
        if pa.types.is_struct(column.type):  # a null struct: its bytes read as valid
            ok &= column.is_valid().to_numpy(zero_copy_only=False)
        return _Decoded(data, ok)
    if field.decode in ("video", "video_frames"):
        return _Decoded(column, column.is_valid().to_numpy(zero_copy_only=False))
    if field.decode in ("utf8", "tokens"):
        if field.fill is not None:
            column = pc.fill_null(column, pa.scalar(field.fill, column.type))
        ok = column.is_valid().to_numpy(zero_copy_only=False)
        if field.decode == "utf8":
            return _Decoded(column, ok)
        texts = [t if t is not None else "" for t in column.to_pylist()]
        assert field.tokenizer is not None  # decode: tokens has one
        ids, lengths = field.tokenizer.encode(texts)
        return _Decoded(ids, ok, starts=np.concatenate([[0], np.cumsum(lengths)]))
    values, ok = dense(column, field.fill)
    fits = np.ones(len(ok), dtype=bool)
    dtype = field.dtype
    if dtype is not None and dtype != values.dtype:
        with np.errstate(all="ignore"):  # checked below instead
            cast = values.astype(dtype)
        if dtype.kind in "biu":  # integers must survive the cast exactly
            same = (cast == values).reshape(len(ok), -1).all(axis=1)
            fits = same | ~ok
        values = cast
    return _Decoded(values, ok, fits)


class Columns:
    """A table's configured fields (`fields:` of format parquet and of the lake formats):
    their checks against a schema, a table's decode, a row's sample. Read-only once made: any
    thread may use it. `storage`: where decode: video_frames finds its videos."""

    def __init__(self, fields: Any, storage: Storage | None) -> None:
        self.storage = storage
        self.fields = [_Field(name, f) for name, f in fields.items()]
        outputs = [o for f in self.fields for o in f.outputs]
        if len(set(outputs)) != len(outputs):
            raise ValueError(f"output field names collide: {sorted(outputs)}")
        # Every column a field reads (the projection): no other column is ever read.
        self.names = sorted({f.col for f in self.fields}
                            | {f.time_col for f in self.fields if f.time_col})

    def decode(self, table: pa.Table) -> dict[str, _Decoded] | str:
        """The fields of `table`'s rows (it holds the columns `names`), or why they cannot
        be decoded."""
        decoded = {}
        for field in self.fields:
            column = table.column(field.col).combine_chunks()
            try:
                decoded[field.name] = _decode_field(field, column)
                if field.time_col is not None:  # the times, a field of their own here
                    times, ok = dense(table.column(field.time_col).combine_chunks(), None)
                    decoded[f"{field.name}\0time"] = _Decoded(times.astype(np.float64), ok)
            except Ragged as e:
                return f"field {field.name!r}: column {field.col!r}: {e}"
            except (pa.ArrowException, ValueError) as e:
                return (f"field {field.name!r}: column {field.col!r}: cannot decode "
                        f"{field.decode or 'numbers'}: {type(e).__name__}: {e}")
        return decoded

    def row(self, decoded: dict[str, _Decoded], row: int, index: int, key: EpochKey
            ) -> dict[str, Any]:
        """Row `row` of a decoded table, as sample `index` (its generator drawn from `key`)."""
        rng = (key.rng(index) if any(f.pipeline or f.frames or f.clip for f in self.fields)
               else None)
        out: dict[str, Any] = {}
        for field in self.fields:  # image fields share one generator, in field order
            column = decoded[field.name]
            if not column.ok[row]:
                what = (" (no image bytes: an image stored only as a path is not embedded)"
                        if field.decode == "image" else "")
                raise ValueError(f"field {field.name!r}: column {field.col!r} holds a "
                                 f"null{what}")
            if not column.fits[row]:
                raise ValueError(f"field {field.name!r}: column {field.col!r}: a value does "
                                 f"not fit {field.dtype}")
            if field.pipeline is not None:
                assert rng is not None  # drawn above for image and video fields
                try:
                    prefix = field.pipeline.cached(index)
                    data = None if prefix is not None else column.values[row].as_py()
                    field.pipeline.write(out, field.name, data, rng, index, prefix)
                except Exception as e:
                    raise ValueError(f"field {field.name!r}: column {field.col!r}: cannot "
                                     f"decode image: {type(e).__name__}: {e}") from e
            elif field.clip is not None:
                assert rng is not None
                field.clip.write(out, field.name, column.values[row].as_py(), rng)
            elif field.frames is not None:
                assert rng is not None
                times = decoded[f"{field.name}\0time"]
                if not times.ok[row]:
                    raise ValueError(f"field {field.name!r}: time_column {field.time_col!r} "
                                     "holds a null")
                path = column.values[row].as_py()
                assert self.storage is not None, "decode: video_frames reads a storage's videos"
                field.frames.write(out, field.name, self.storage, path,
                                   float(times.values[row]), rng)
            elif field.decode == "utf8":
                out[field.name], out[f"{field.name}_length"] = utf8_padded(
                    column.values[row].as_py(), field.max_bytes)
            elif field.decode == "tokens":
                assert column.starts is not None  # tokens are decoded with their starts
                a, b = int(column.starts[row]), int(column.starts[row + 1])
                n = min(b - a, field.max_tokens)
                ids = np.full(field.max_tokens, field.pad_id, np.int64)
                ids[:n] = column.values[a : a + n]
                out[field.name], out[f"{field.name}_length"] = ids, np.int64(n)
            else:
                out[field.name] = column.values[row].copy()  # the row group is dropped later
        return out

    def decode_version(self) -> str:
        from ..images import decode_version

        return decode_version([f.pipeline for f in self.fields])

    def use_prefix_cache(self, scope: Any) -> None:
        from ..sources.prefix_cache import use_cache

        use_cache(scope, [(f.name, f.pipeline) for f in self.fields])


def _renames(schema: pa.Schema, field_ids: dict[str, int]) -> dict[str, str]:
    """column -> its name in a file of `schema`, where the file wrote its field id under
    another name (Iceberg: a column renamed since the file was written)."""
    if not field_ids:
        return {}
    in_file = {}
    for f in schema:
        fid = (f.metadata or {}).get(b"PARQUET:field_id")
        if fid is not None:
            in_file[int(fid)] = f.name
    return {col: in_file[fid] for col, fid in field_ids.items()
            if fid in in_file and in_file[fid] != col}


def _as_named(schema: pa.Schema, renames: dict[str, str]) -> pa.Schema:
    """`schema` with its columns under the names the config gives them."""
    if not renames:
        return schema
    back = {v: k for k, v in renames.items()}
    return pa.schema([f.with_name(back[f.name]) if f.name in back else f for f in schema],
                     metadata=schema.metadata)


class Parquet(Sampled):
    """Thread-safe: the decoded row group is replaced as a whole, never changed in place.

    `keys`: these files, in this order, instead of what `pattern` lists (a lake table's data
    files); `field_ids`: column -> Iceberg field id, by which a file that wrote a column under
    an older name (renamed since) is read (the file's `PARQUET:field_id` metadata)."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None,
                 keys: list[str] | None = None, field_ids: dict[str, int] | None = None
                 ) -> None:
        self.storage = storage
        self.cols = Columns(cfg.fields, storage)
        self.fields = self.cols.fields
        self.columns = self.cols.names
        skip = cfg.on_error == "skip"
        infos = ([storage.info(k) for k in keys] if keys is not None
                 else storage.list(pattern or DEFAULT_PATTERN))
        if not infos:
            raise ValueError(f"{storage.url}: no files match {pattern or DEFAULT_PATTERN!r}")
        types: dict[str, tuple[pa.DataType, str]] = {}  # column -> type, first file with it
        group_file, group_index, group_rows = [], [], []
        # Per file: column -> its name in that file, where the two differ.
        self._renames: list[dict[str, str]] = []
        for f, o in enumerate(infos):
            where = storage.where(o.key)
            try:
                with pq.ParquetFile(storage.local_path(o.key)) as pf:
                    schema, meta = pf.schema_arrow, pf.metadata
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{where}: not a readable Parquet file: {e}") from None
            self._renames.append(_renames(schema, field_ids or {}))
            schema = _as_named(schema, self._renames[-1])
            leaves: dict[str, tuple[str, ...]] = {}
            for field in self.fields:
                t = field.check(where, schema)
                first = types.setdefault(field.col, (t, where))
                if field.dtype is None and field.decode is None and first[0] != t:
                    raise ValueError(f"{where}: field {field.name!r}: column {field.col!r} is "
                                     f"{t}, but {first[0]} in {first[1]}; set the field's "
                                     "dtype")
                if field.fill is None and not skip:
                    leaves[field.name] = field.null_leaves(t)
            for g in range(meta.num_row_groups):
                if leaves:
                    self._refuse_nulls(where, g, _null_counts(meta, g), leaves)
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
        self._decoded: tuple[int, dict[str, _Decoded] | str] = (-1, {})
        self.length_column = cfg.length_column
        # An optional part (formats/_contract.py): present only with length_column.
        self.sample_lengths = None if cfg.length_column is None else self._lengths
    def _lengths(self) -> np.ndarray:
        """Each row's token count from `length_column`: a list column's list lengths, or
        an integer column's values (read once, that column only)."""
        col, parts = self.length_column, []
        for f, key in enumerate(self.keys.tolist()):
            where = self.storage.where(key)
            with pq.ParquetFile(self.storage.local_path(key)) as pf:
                names = _as_named(pf.schema_arrow, self._renames[f]).names
                if col not in names:
                    raise ValueError(f"{where}: length_column {col!r}: no such column; the file "
                                     f"has columns {names}")
                column = pf.read(columns=[self._renames[f].get(col, col)]).column(0)
                column = column.combine_chunks()
            if _is_list(column.type):
                column = pc.list_value_length(column)
            elif not pa.types.is_integer(column.type):
                raise ValueError(f"{where}: length_column {col!r}: column is {column.type}, "
                                 "expected integers (the length) or lists (their length)")
            if column.null_count:
                raise ValueError(f"{where}: length_column {col!r}: {column.null_count} null(s)")
            parts.append(column.to_numpy(zero_copy_only=False).astype(np.int64))
        out = np.concatenate(parts)
        if len(out) and out.min() < 0:
            raise ValueError(f"length_column {col!r}: a negative length ({int(out.min())})")
        return out
    def _refuse_nulls(self, where: str, g: int, counts: dict[str, int | None],
                      leaves: dict[str, tuple[str, ...]]) -> None:
        for field in self.fields:
            paths = leaves.get(field.name, ())
            nulls = sum(n or 0 for path, n in counts.items()
                        if any(path == p or path.startswith(p + ".") for p in paths))
            if nulls and field.decode == "image":
                raise ValueError(f"{where}: field {field.name!r}: column {field.col!r} has no "
                                 f"image bytes in {nulls} row(s) of row group {g} (images "
                                 "stored as file paths, not embedded: `datasets` embeds them "
                                 "in push_to_hub, not in to_parquet); set on_error: skip to "
                                 "replace those samples")
            if nulls:
                raise ValueError(f"{where}: field {field.name!r}: column {field.col!r} holds "
                                 f"{nulls} null(s) in row group {g} (a pandas NaN or None is "
                                 "stored as a null); set the field's fill (the value a null "
                                 "becomes), or on_error: skip to replace those samples")
    def _decode(self, g: int) -> dict[str, _Decoded] | str:
        """Row group g's fields, or why it cannot be decoded."""
        f = int(self.group_file[g])
        renames = self._renames[f]
        in_file = [renames.get(c, c) for c in self.columns]
        try:
            table = self._files.get(str(self.keys[f])).read_row_group(
                int(self.group_index[g]), columns=in_file, use_threads=False)
        except (pa.ArrowException, OSError) as e:
            return f"cannot read the row group: {type(e).__name__}: {e}"
        if renames:
            table = table.select(in_file).rename_columns(self.columns)
        return self.cols.decode(table)

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        g, row = self.groups.locate(index)
        cached_g, decoded = self._decoded
        if cached_g != g:
            decoded = self._decode(g)
            self._decoded = (g, decoded)  # one row group per process: block shuffle's unit
        if isinstance(decoded, str):
            raise ValueError(decoded)
        return self.cols.row(decoded, row, index, key)

    def use_prefix_cache(self, scope: Any) -> None:
        self.cols.use_prefix_cache(scope)

    def source_of(self, index: int) -> str:
        place = self.place_of(index)
        return f"{place['file']} row group {place['row_group']} row {place['row']}"

    def place_of(self, index: int) -> dict[str, Any]:
        g, row = self.groups.locate(index)
        key = str(self.keys[self.group_file[g]])
        return {"file": self.storage.where(key), "row_group": int(self.group_index[g]),
                "row": int(row)}

    def objects_of(self, indices: np.ndarray) -> list[str]:
        groups = self.groups.shards_of(indices)
        return self.keys[np.unique(self.group_file[groups])].tolist()
