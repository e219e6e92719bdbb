"""`format: mds`: a Mosaic Streaming (MDSWriter) folder, read as Mosaic's own reader reads it.

The folder's `index.json` (version 2) lists the shards in order; sample i is sample i of that
order (shards in the order listed, records in the order of each shard), which is the order of
Mosaic's `StreamingDataset(shuffle=False)` over one stream. Each shard entry gives the
columns (`column_names`, `column_encodings`, `column_sizes`: a fixed size, or null for a
variable one), the sample count, the uncompressed file (`raw_data`) and, when the writer was
given `compression`, the compressed one (`zip_data`), which is what the folder holds then.

A record is a uint32 LE size for each variable-size column, in column order, then the columns'
bytes one after another (see _chunks.py for the shard's offset table). Encodings, as Mosaic
encodes them (`streaming/base/format/mds/encodings`):

    int8 ... uint64, float16/32/64   numbers, little-endian (`int`: int64, `float`: float64)
    str_int, str_float, str_decimal  numbers written as text: int64, float64, float64
    ndarray[:dtype[:shape]]          an array; what the encoding leaves out, each record holds:
                                     [dtype code: 1 byte] [ndim << 2 | shape width: 1 byte]
                                     [shape] then the values
    json                             numbers or (nested) lists of them
    str, bytes                       text: uint8[max_bytes] and `<field>_length`
    jpeg[:quality], png, pil         images, through the image pipeline (`pil`: raw pixels)

`pkl` is refused (unpickling runs code). Compression: zstd, gz and bz2 (Mosaic's br and snappy
are refused with a message). Shard hashes are not checked: the storage checks files against
the listing instead (see sources/).
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import numpy as np

from ..sources import Storage
from ._chunks import ChunkedDataset, Column, Kind, Shard, check_keys, png_of_pil, read_index
from ._chunks import split_sized as _split_sized
from ._chunks import utf8 as _utf8

_NUMBERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float16", "float32", "float64")
# Mosaic's NDArray codes: value dtypes, and the dtype of the shape that precedes the values.
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32",
                 33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_SHAPE_DTYPES = ("<u1", "<u2", "<u4", "<u8")
SUPPORTED = ("bytes, str, int, float, int8 ... uint64, float16/32/64, str_int, str_float, "
             "str_decimal, ndarray[:dtype[:shape]], json, jpeg[:quality], png, pil")


def _scalar(dtype: str) -> Any:
    dt = np.dtype(dtype).newbyteorder("<")
    return lambda data: np.frombuffer(data, dt, 1)[0].astype(dt.newbyteorder("="))


def _ndarray(spec: str) -> Any:
    args = spec.split(":") if spec else []
    if len(args) > 2 or (args and args[0] not in _VALUE_DTYPES.values()):
        raise ValueError(f"bad ndarray encoding arguments {spec!r}")
    fixed_dtype = np.dtype(args[0]).newbyteorder("<") if args else None
    fixed_shape = tuple(int(n) for n in args[1].split(",")) if len(args) == 2 else None

    def decode(data: bytes) -> np.ndarray:
        at = 0
        dtype = fixed_dtype
        if dtype is None:
            code = data[0]
            if code not in _VALUE_DTYPES:
                raise ValueError(f"unknown dtype code {code}")
            dtype = np.dtype(_VALUE_DTYPES[code]).newbyteorder("<")
            at = 1
        shape = fixed_shape
        if shape is None:
            ndim, width = data[at] >> 2, data[at] & 3
            shape_dtype = np.dtype(_SHAPE_DTYPES[width])
            shape = tuple(int(n) for n in np.frombuffer(data, shape_dtype, ndim, at + 1))
            at += 1 + ndim * shape_dtype.itemsize
        values = np.frombuffer(data, dtype, offset=at)
        if values.size != int(np.prod(shape)):
            raise ValueError(f"{values.size} values for shape {list(shape)}")
        return values.reshape(shape).astype(dtype.newbyteorder("="))

    return decode


def _json_numbers(data: bytes) -> Any:
    value = np.asarray(json.loads(data.decode("utf-8")))
    if value.dtype.kind not in "biuf":
        raise ValueError(f"a JSON value of {value.dtype} (a batch carries numbers and lists of "
                         "numbers)")
    return value


def column(name: str, encoding: str) -> Column:
    """The decoder of one MDS column; ValueError naming it for what stoker does not read."""
    base, _, args = encoding.partition(":")
    if base in _NUMBERS and not args:
        return Column(name, encoding, Kind.NUMBER, _scalar(base))
    simple = {"int": (Kind.NUMBER, _scalar("int64")), "float": (Kind.NUMBER, _scalar("float64")),
              "str_int": (Kind.NUMBER, lambda d: np.int64(int(d.decode("utf-8")))),
              "str_float": (Kind.NUMBER, lambda d: np.float64(float(d.decode("utf-8")))),
              "str_decimal": (Kind.NUMBER,
                              lambda d: np.float64(float(Decimal(d.decode("utf-8"))))),
              "json": (Kind.NUMBER, _json_numbers), "str": (Kind.TEXT, _utf8),
              "bytes": (Kind.TEXT, bytes), "png": (Kind.IMAGE, bytes),
              "pil": (Kind.IMAGE, png_of_pil)}
    if base in simple and not args:
        return Column(name, encoding, *simple[base])
    if base == "jpeg":  # jpeg:quality: the quality only mattered when writing
        return Column(name, encoding, Kind.IMAGE, bytes)
    if base == "ndarray":
        try:
            return Column(name, encoding, Kind.NUMBER, _ndarray(args))
        except ValueError as e:
            raise ValueError(f"column {name!r}: encoding {encoding!r}: {e}") from None
    why = ("pickled objects are never unpickled on the server (unpickling runs code)"
           if base == "pkl" else "not an encoding stoker reads")
    raise ValueError(f"column {name!r}: encoding {encoding!r}: {why}; supported: {SUPPORTED}")


class Mds(ChunkedDataset):
    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        key, index = read_index(storage, pattern, "mds")
        where = storage.where(key)
        if not isinstance(index, dict) or index.get("version") != 2 or "shards" not in index:
            raise ValueError(f"{where}: not a Mosaic Streaming index (version 2 with `shards`)")
        shards, columns = [], None
        sizes: dict[str, int | None] = {}
        for i, s in enumerate(index["shards"]):
            if s.get("format") != "mds":
                raise ValueError(f"{where}: shard {i} has format {s.get('format')!r}; stoker "
                                 "reads MDS shards (format: mds)")
            names = (s["column_names"], s["column_encodings"], s["column_sizes"])
            if columns is None:
                columns = names
            elif names != columns:
                raise ValueError(f"{where}: shard {i}'s columns differ from shard 0's")
            raw, zipped = s["raw_data"], s.get("zip_data")
            if zipped:
                codec = str(s.get("compression") or "").partition(":")[0]
                shards.append(Shard(zipped["basename"], int(s["samples"]), codec,
                                    int(raw["bytes"])))
                sizes[zipped["basename"]] = zipped.get("bytes")
            else:
                shards.append(Shard(raw["basename"], int(s["samples"])))
                sizes[raw["basename"]] = raw.get("bytes")
        if not shards or columns is None:
            raise ValueError(f"{where}: the index lists no shards")
        check_keys(storage, sizes, key)
        self._sizes = [None if size is None else int(size) for size in columns[2]]
        # Only the configured fields' columns must be readable: the others are skipped.
        wanted = {f.column or n for n, f in cfg.fields.items()}
        cols = [column(n, e) if n in wanted else Column(n, e, Kind.NUMBER, bytes)
                for n, e in zip(columns[0], columns[1], strict=True)]
        super().__init__(cfg, storage, shards, cols, where)

    def split(self, record: memoryview, where: str, shard: int, pos: int
              ) -> list[memoryview | bytes]:
        return _split_sized(record, self._sizes, where)
