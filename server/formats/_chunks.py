"""What `format: mds` and `format: litdata` share: shard files whose records are found through
an offset table, and columns decoded into what a batch carries.

Both peers write a shard (an MDS shard, a LitData chunk) as

    uint32 LE   n, the number of records
    uint32 LE   offsets[n + 1], each record's first byte in the file, then the end of the last
    ...         the records (MDS puts its shard config between the table and the first one)

optionally compressed whole (the index names the codec). Uncompressed shards are memory-mapped
through the storage's local file and records are sliced out of the map; a compressed shard is
read and decompressed whole, and each process keeps the last `DECODED_SHARDS` of them, so
`shuffle: block` (the default) decompresses a shard once per window, `shuffle: global` about
once per sample.

A column is one named value of a record; its `Kind` says what a field made from it carries:
numbers (an array or scalar, dtype kept), text (str or bytes, as zero-padded uint8[max_bytes]
plus `<field>_length`, as `format: jsonl` serves utf8), or an image (through server/images.py's
pipeline, as `format: tar` decodes images).
"""

from __future__ import annotations

import bz2
import enum
import gzip
import io
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._lru import LRU
from ..images import decode_version, image_pipeline
from ..order.sampling import EpochKey
from ..sources import Storage
from ..sources.prefix_cache import use_cache
from ._contract import Sampled
from ._shards import ShardIndex
from .memmap import OpenMaps

DECODED_SHARDS = 2  # decompressed shards each process keeps (a shard is ~64 MiB by default)
_U32 = np.dtype("<u4")


class Kind(enum.Enum):
    NUMBER = "number"  # decode(bytes) -> numpy array or scalar
    TEXT = "text"  # decode(bytes) -> bytes (str columns: checked to be UTF-8)
    IMAGE = "image"  # decode(bytes) -> encoded image bytes (JPEG, PNG, ...)


@dataclass(frozen=True)
class Column:
    """A column of the peer's records: its name and encoding as the peer's index writes them."""

    name: str
    encoding: str
    kind: Kind
    decode: Callable[[bytes], Any]


@dataclass(frozen=True)
class Shard:
    key: str  # the file to read, relative to the dataset root
    samples: int
    codec: str | None = None  # None, or the codec the whole file is compressed with
    raw_bytes: int | None = None  # its size once decompressed, where the index says


def utf8(data: bytes) -> bytes:
    data.decode("utf-8")  # the peer's reader decodes str columns: invalid UTF-8 fails there too
    return data


def png_of_pil(data: bytes) -> bytes:
    """A PIL raw image as both peers write their `pil` encoding ([width, height, len(mode)] as
    uint32 LE, the mode, the raw pixels) as an uncompressed PNG, for the image pipeline, which
    decodes encoded bytes: PNG is lossless, so the pixels are the peer's."""
    from PIL import Image

    width, height, mode_size = (int(x) for x in np.frombuffer(data, _U32, 3))
    mode = bytes(data[12: 12 + mode_size]).decode("ascii")
    out = io.BytesIO()
    Image.frombytes(mode, (width, height), data[12 + mode_size:]).save(
        out, format="PNG", compress_level=0)
    return out.getvalue()


def decompress(codec: str, data: bytes, raw_bytes: int | None, where: str) -> bytes:
    if codec == "zstd":
        import zstandard

        # A streaming decompressor: frames need not record their content size.
        out = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    elif codec == "gz":
        out = gzip.decompress(data)
    elif codec == "bz2":
        out = bz2.decompress(data)
    else:
        raise ValueError(f"{where}: compression {codec!r} is not supported (zstd, gz and bz2 "
                         "are); decompress the shards or write them again with one of those")
    if raw_bytes is not None and len(out) != raw_bytes:
        raise ValueError(f"{where}: decompressed to {len(out)} bytes, the index says {raw_bytes}")
    return out


class _Field:
    """One configured output field: a column, and how it becomes arrays."""

    def __init__(self, name: str, cfg: Any, column: Column) -> None:
        self.name, self.column = name, column
        what = f"field {name!r}: column {column.name!r} (encoding {column.encoding!r})"
        image = column.kind is Kind.IMAGE
        if not image and (cfg.size is not None or cfg.transforms is not None):
            raise ValueError(f"{what} is not an image: size and transforms apply to images")
        text = column.kind is Kind.TEXT
        if text and cfg.max_bytes is None:
            raise ValueError(f"{what} holds text or bytes: give max_bytes (it is served as "
                             f"uint8[max_bytes], zero-padded, and {name}_length)")
        if not text and cfg.max_bytes is not None:
            raise ValueError(f"{what}: max_bytes applies to str and bytes columns only")
        self.max_bytes = cfg.max_bytes
        self.pipeline = image_pipeline(cfg) if image else None
        self.output_names = ([name, f"{name}_length"] if text
                             else self.pipeline.output_names(name) if self.pipeline else [name])

    def convert(self, data: bytes, out: dict[str, Any], rng: np.random.Generator,
                index: int = 0) -> None:
        if self.pipeline is not None:
            prefix = self.pipeline.cached(index)
            value = None if prefix is not None else self.column.decode(data)
            self.pipeline.write(out, self.name, value, rng, index, prefix)
            return
        value = self.column.decode(data)
        if self.max_bytes is not None:
            if len(value) > self.max_bytes:  # cut, at a character boundary for str columns
                value = value[: self.max_bytes]
                if self.column.encoding in ("str", "text"):
                    value = value.decode("utf-8", "ignore").encode("utf-8")
            padded = np.zeros(self.max_bytes, np.uint8)
            padded[: len(value)] = np.frombuffer(value, np.uint8)
            out[self.name] = padded
            out[f"{self.name}_length"] = np.int64(len(value))
        else:
            out[self.name] = value


def fields_of(cfg: Any, columns: Sequence[Column], where: str) -> list[_Field]:
    """The configured fields, each matched to its column (by `column:`, else by its name)."""
    by_name = {c.name: c for c in columns}
    fields = []
    for name, f in cfg.fields.items():
        column = by_name.get(f.column or name)
        if column is None:
            raise ValueError(f"{where}: field {name!r}: no column {f.column or name!r}; the "
                             f"columns are {sorted(by_name)}")
        fields.append(_Field(name, f, column))
    names = [n for f in fields for n in f.output_names]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: output field names collide: {sorted(names)}")
    return fields


class ChunkedDataset(Sampled):
    """Samples from `shards` in their order, each split into column payloads by the format's
    `split(record) -> list[bytes]` (one per column of `columns`, in order).

    Thread-safe: the arrays are never changed after open; maps and decoded shards are kept
    under locks."""

    def __init__(self, cfg: Any, storage: Storage, shards: Sequence[Shard],
                 columns: Sequence[Column], where: str) -> None:
        self.storage = storage
        self.fields = fields_of(cfg, columns, where)
        self.columns = list(columns)
        self._positions = [self.columns.index(f.column) for f in self.fields]
        self.shards = ShardIndex([s.samples for s in shards])
        self.length = self.shards.length
        if self.length == 0:
            raise ValueError(f"{where}: the index lists no samples")
        self.shard_starts = self.shards.shard_starts
        # Fixed-width numpy arrays, not lists of objects: nothing for copy-on-write to touch.
        self.shard_keys = np.array([s.key for s in shards])
        self._codecs = np.array([s.codec or "" for s in shards])
        self._raw_bytes = np.array([-1 if s.raw_bytes is None else s.raw_bytes for s in shards],
                                   np.int64)
        self._counts = np.array([s.samples for s in shards], np.int64)
        self._maps: OpenMaps[np.ndarray] = OpenMaps(
            storage, lambda key, path: np.memmap(path, np.uint8, "r") if path.stat().st_size
            else np.zeros(0, np.uint8))
        self._decoded: LRU[int, bytes] = LRU(max_items=DECODED_SHARDS)
        self._lock = threading.Lock()

    # -- the format's part ---------------------------------------------------------------------
    def split(self, record: memoryview, where: str, shard: int, pos: int
              ) -> list[memoryview | bytes]:
        """Record `pos` of `shard` cut into its columns' bytes, in column order."""
        raise NotImplementedError

    def inflate(self, codec: str, data: bytes, raw_bytes: int | None, where: str) -> bytes:
        """A compressed shard's bytes as the uncompressed layout."""
        return decompress(codec, data, raw_bytes, where)

    # -- reading -------------------------------------------------------------------------------
    def shard_bytes(self, shard: int) -> memoryview:
        """The shard's (uncompressed) bytes, unsigned: of a memory map, or of a decompressed
        copy."""
        key = str(self.shard_keys[shard])
        codec = str(self._codecs[shard])
        if not codec:
            return self._maps.get(key).data.cast("B")
        raw = int(self._raw_bytes[shard])
        with self._lock:
            data = self._decoded.get_or_make(shard, lambda: self.inflate(
                codec, self.storage.read(key), None if raw < 0 else raw, self.storage.where(key)))
        return memoryview(data).cast("B")

    def record(self, shard: int, pos: int) -> memoryview:
        """Record `pos` of `shard`, checked against the shard's own header."""
        data = self.shard_bytes(shard)
        where = self.storage.where(str(self.shard_keys[shard]))
        count = int(self._counts[shard])
        if len(data) < 4 * (count + 2):
            raise EOFError(f"{where}: {len(data)} bytes, too short for the header of {count} "
                           "records; the shard is truncated")
        n = int(np.frombuffer(data, _U32, 1)[0])
        if n != count:
            raise ValueError(f"{where}: holds {n} records, the index says {count}")
        begin, end = (int(x) for x in np.frombuffer(data, _U32, 2, 4 + 4 * pos))
        if not begin <= end <= len(data):
            raise EOFError(f"{where}: record {pos} spans bytes {begin} to {end} of "
                           f"{len(data)}; the shard is truncated or corrupt")
        return data[begin:end]

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        shard, pos = self.shards.locate(index)
        where = f"{self.storage.where(str(self.shard_keys[shard]))} record {pos}"
        parts = self.split(self.record(shard, pos), where, shard, pos)
        rng = key.rng(index)  # shared by the image fields, in field order
        out: dict[str, Any] = {}
        for field, p in zip(self.fields, self._positions, strict=True):
            try:
                field.convert(bytes(parts[p]), out, rng, index)
            except Exception as e:
                c = field.column
                raise ValueError(f"{where}: column {c.name!r} (encoding {c.encoding!r}): "
                                 f"{type(e).__name__}: {e}") from e
        return out

    def decode_version(self) -> str:
        return decode_version([f.pipeline for f in self.fields])

    def use_prefix_cache(self, scope: Any) -> None:
        use_cache(scope, [(f.name, f.pipeline) for f in self.fields])

    def source_of(self, index: int) -> str:
        shard, pos = self.shards.locate(index)
        return f"{self.storage.where(str(self.shard_keys[shard]))} record {pos}"

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return self.shard_keys[self.shards.shards_of(indices)].tolist()


def split_sized(record: memoryview, sizes: Sequence[int | None], where: str
                ) -> list[memoryview | bytes]:
    """Cut a record into its columns: `sizes[i]` bytes for column i, or where it is None, the
    next uint32 of the size table that opens the record (one entry per None, in order)."""
    variable = sum(s is None for s in sizes)
    if len(record) < 4 * variable:
        raise ValueError(f"{where}: {len(record)} bytes, shorter than its size table")
    table = iter(np.frombuffer(record, _U32, variable).tolist())
    parts: list[memoryview | bytes] = []  # a record's columns, as `split` gives them
    at = 4 * variable
    for size in sizes:
        n = next(table) if size is None else size
        parts.append(record[at: at + n])
        at += n
    if at > len(record):
        raise ValueError(f"{where}: its columns need {at} bytes, the record has {len(record)}; "
                         "the shard is corrupt")
    return parts


def check_keys(storage: Storage, sizes: dict[str, int | None], index_key: str) -> None:
    """Every file the index names must be in the folder, of the size it gives (where it gives
    one). Lists the folder: what the dataset's fingerprint covers."""
    listed = {o.key: o.size for o in storage.list()}
    missing = [k for k in sizes if k not in listed]
    if missing:
        raise ValueError(f"{storage.where(index_key)} names {len(missing)} files that are not "
                         f"there, e.g. {storage.where(missing[0])}")
    for key, size in sizes.items():
        if size is not None and listed[key] != size:
            raise ValueError(f"{storage.where(key)}: {listed[key]} bytes, the index says "
                             f"{size}; the file is truncated or was rewritten")


def read_index(storage: Storage, pattern: str | None, fmt: str) -> tuple[str, Any]:
    """(the index file's key, its JSON): `index.json` in the source folder, or the file the
    source names."""
    key = "index.json"
    if pattern is not None:
        # A source naming one local file comes as its name, glob characters escaped.
        if set("*?[") & set(re.sub(r"\[([*?\[])\]", "", pattern)):
            raise ValueError(f"{storage.url}/{pattern}: a {fmt} source is the folder that "
                             "holds index.json (or that file itself), not a glob")
        key = re.sub(r"\[([*?\[])\]", r"\1", pattern)
    try:
        return key, json.loads(storage.read(key))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{storage.where(key)}: not a JSON index: {e}") from None
