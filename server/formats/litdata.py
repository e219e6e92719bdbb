"""`format: litdata`: a LitData folder (`optimize`, `BinaryWriter`), read as LitData's own
`StreamingDataset` reads it.

The folder's `index.json` lists the chunks in order (`chunks`: `filename`, `chunk_size` =
its item count) and how items were written (`config`): `data_format`, the serializer of each
leaf of an item, and `data_spec`, the item's structure (torch's pytree spec as JSON). Sample i
is item i of the chunks in the order listed: the order of `StreamingDataset(shuffle=False)`.
A column is a leaf, named by its key (`{"image": ..., "label": ...}` -> `image`, `label`; nested
keys joined with `.`; tuple and list positions as `0`, `1`...).

An item is a uint32 LE size for every leaf, then the leaves' bytes (see _chunks.py for the
chunk's offset table). Leaf serializers, as LitData writes them (`streaming/serializers.py`):

    int, float, bool                  int64, float64, bool
    numpy                             [dtype code, ndim, shape...] as uint32 LE, the values
    no_header_numpy:CODE              1-d values of dtype CODE
    tensor                            [dtype code, ndim, shape...] as uint32, the values: the
                                      header big-endian since LitData 0.2.57, little before;
                                      stoker takes the one whose sizes add up
    no_header_tensor:CODE             1-d values of torch dtype CODE
    str, text, bytes                  text: uint8[max_bytes] and `<field>_length`
    jpeg, image:EXT, pil              images, through the image pipeline (`pil`: raw pixels)

Chunks may be compressed whole (`compression: zstd`, `compression_level` chunk), in frames of
items (`batch`, LitData's default for zstd) or item by item (`sample`). Chunks of rows of plain
values may hold them in an Arrow table appended to the chunk instead of the items (what newer
LitData writes for such rows); those are read with pyarrow. Refused with a message: encrypted
chunks, item loaders other than PyTreeLoader (TokensLoader...), and the other serializers
(pickle, json, video, audio...).
"""

from __future__ import annotations

import json
import struct
import threading
from typing import Any

import numpy as np

from .._lru import LRU
from ..sources import Storage
from ._chunks import (
    DECODED_SHARDS,
    ChunkedDataset,
    Column,
    Kind,
    Shard,
    check_keys,
    decompress,
    png_of_pil,
    read_index,
    split_sized,
    utf8,
)

# LitData's dtype codes (litdata/constants.py); None: no numpy dtype a batch can carry.
_NUMPY_CODES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", None, None, "bool")
_TORCH_CODES = ("float32", "float32", "float64", "float64", None, None, None, None, "float16",
                "float16", None, "uint8", "int8", "int16", "int16", "int32", "int32",
                "int64", "int64", "bool", "uint16")
_FOOTER_MAGIC = b"LDARW01\0"  # an Arrow IPC table of the chunk's rows, appended to it
_FRAMED_MAGIC = b"LDFZ01\0\0"  # compression_level: batch
_FRAMED = struct.Struct("<8sHHIII")  # magic, version, flags, items, rows per frame, frames
_FRAME = struct.Struct("<IIQII")  # first item, items, offset, compressed and raw length
SUPPORTED = ("int, float, bool, str, text, bytes, numpy, no_header_numpy, tensor, "
             "no_header_tensor, jpeg, image:*, pil")


def _dtype(codes: tuple[str | None, ...], code: int, what: str) -> np.dtype:
    name = codes[code] if 0 <= code < len(codes) else None
    if name is None:
        raise ValueError(f"{what} dtype code {code} is not a number type a batch can carry")
    return np.dtype(name).newbyteorder("<")


def _values(data: bytes, dtype: np.dtype, shape: tuple[int, ...] | None = None) -> Any:
    values = np.frombuffer(data, dtype)
    if shape is not None:
        if values.size != int(np.prod(shape)):
            raise ValueError(f"{values.size} values for shape {list(shape)}")
        values = values.reshape(shape)
    return values.astype(dtype.newbyteorder("="))


def _numpy(data: bytes) -> np.ndarray:
    code, ndim = struct.unpack_from("<II", data)
    shape = struct.unpack_from(f"<{ndim}I", data, 8)
    return _values(data[8 + 4 * ndim:], _dtype(_NUMPY_CODES, code, "numpy"), shape)


def _tensor(data: bytes) -> np.ndarray:
    for order in ">", "<":  # LitData >= 0.2.57 writes the header big-endian, earlier native
        code, ndim = struct.unpack_from(f"{order}II", data)
        if not 0 <= code < len(_TORCH_CODES) or len(data) < 8 + 4 * ndim:
            continue
        shape = struct.unpack_from(f"{order}{ndim}I", data, 8)
        dtype = _dtype(_TORCH_CODES, code, "tensor")
        if dtype.itemsize * int(np.prod(shape)) == len(data) - 8 - 4 * ndim:
            return _values(data[8 + 4 * ndim:], dtype, shape)
    raise ValueError("not a LitData tensor: its header and size do not agree")


def _flat(codes: tuple[str | None, ...], what: str, code: int) -> Any:
    dtype = _dtype(codes, code, what)
    return lambda data: _values(data, dtype)


def column(name: str, fmt: str) -> Column:
    """The decoder of one leaf; ValueError naming it for what stoker does not read."""
    base, _, arg = fmt.partition(":")
    simple = {"int": (Kind.NUMBER, lambda d: np.int64(struct.unpack("<q", d)[0])),
              "float": (Kind.NUMBER, lambda d: np.float64(struct.unpack("<d", d)[0])),
              "bool": (Kind.NUMBER, lambda d: np.bool_(d[0] != 0)),
              "numpy": (Kind.NUMBER, _numpy), "tensor": (Kind.NUMBER, _tensor),
              "str": (Kind.TEXT, utf8), "text": (Kind.TEXT, utf8), "bytes": (Kind.TEXT, bytes),
              "jpeg": (Kind.IMAGE, bytes), "pil": (Kind.IMAGE, png_of_pil)}
    try:
        if base in simple and not arg:
            return Column(name, fmt, *simple[base])
        if base == "image":  # image:EXT: the file's own bytes
            return Column(name, fmt, Kind.IMAGE, bytes)
        if base in ("no_header_numpy", "no_header_tensor") and arg.isdigit():
            codes = _NUMPY_CODES if base == "no_header_numpy" else _TORCH_CODES
            return Column(name, fmt, Kind.NUMBER, _flat(codes, base, int(arg)))
    except ValueError as e:
        raise ValueError(f"column {name!r}: serializer {fmt!r}: {e}") from None
    raise ValueError(f"column {name!r}: serializer {fmt!r} is not one stoker reads; supported: "
                     f"{SUPPORTED}")


def leaf_names(spec: str | None, count: int) -> list[str]:
    """The leaves' names from a `data_spec` (torch's pytree TreeSpec as JSON, protocol 1)."""
    if spec is None:
        return [str(i) for i in range(count)]
    names: list[str] = []

    def walk(node: dict[str, Any], path: list[str]) -> None:
        kind, children = node.get("type"), node.get("children_spec") or []
        if kind is None:
            names.append(".".join(path) or "0")
            return
        if kind in ("builtins.dict", "collections.OrderedDict", "collections.defaultdict"):
            context = json.loads(node["context"])
            keys = context[1] if kind == "collections.defaultdict" else context
        elif kind in ("builtins.list", "builtins.tuple"):
            keys = list(range(len(children)))
        else:
            raise ValueError(f"items of type {kind} (stoker reads dicts, lists and tuples)")
        for k, child in zip(keys, children, strict=True):
            walk(child, [*path, str(k)])

    protocol, root = json.loads(spec)
    if protocol != 1:
        raise ValueError(f"data_spec protocol {protocol} (stoker reads protocol 1)")
    walk(root, [])
    if len(names) != count:
        raise ValueError(f"data_spec has {len(names)} leaves, data_format {count}")
    return names


def _plain(value: Any, fmt: str) -> bytes:
    """A value of an Arrow row as the leaf's serializer writes it (for the same decoders)."""
    if fmt == "int":
        return struct.pack("<q", value)
    if fmt == "float":
        return struct.pack("<d", value)
    if fmt == "bool":
        return b"\1" if value else b"\0"
    if fmt in ("str", "text"):
        return value.encode("utf-8")
    if fmt == "bytes":
        return bytes(value)
    raise ValueError(f"a value of serializer {fmt!r} in an Arrow row")


class Litdata(ChunkedDataset):
    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        key, index = read_index(storage, pattern, "litdata")
        where = storage.where(key)
        try:
            config, chunks = index["config"], index["chunks"]
            formats = list(config["data_format"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where}: not a LitData index (`chunks` and `config` with "
                             f"`data_format`): {type(e).__name__}: {e}") from None
        loader = config.get("item_loader") or "PyTreeLoader"
        if loader != "PyTreeLoader":
            raise ValueError(f"{where}: item_loader {loader}: stoker reads PyTreeLoader chunks "
                             "(one item per sample) only")
        if config.get("encryption"):
            raise ValueError(f"{where}: the chunks are encrypted; stoker reads plain chunks")
        codec = None
        if config.get("compression"):
            codec, _, _ = str(config["compression"]).partition(":")
            level = config.get("compression_level") or "chunk"
            if level not in ("chunk", "batch", "sample"):
                raise ValueError(f"{where}: compression_level {level!r} (chunk, batch or sample)")
            codec = {"chunk": codec, "batch": "framed", "sample": None}[level]
            self._sample_codec = str(config["compression"]).partition(":")[0] \
                if level == "sample" else None
        else:
            self._sample_codec = None
        try:
            names = leaf_names(config.get("data_spec"), len(formats))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: data_spec: {e}") from None
        self._formats = formats
        shards = [Shard(c["filename"], int(c["chunk_size"]), codec) for c in chunks]
        check_keys(storage, {s.key: None for s in shards}, key)
        wanted = {f.column or n for n, f in cfg.fields.items()}
        cols = [column(n, f) if n in wanted else Column(n, f, Kind.NUMBER, bytes)
                for n, f in zip(names, formats, strict=True)]
        self._footers: LRU[int, Any] = LRU(max_items=DECODED_SHARDS)
        self._footer_lock = threading.Lock()
        super().__init__(cfg, storage, shards, cols, where)

    def inflate(self, codec: str, data: bytes, raw_bytes: int | None, where: str) -> bytes:
        if codec != "framed":
            return decompress(codec, data, raw_bytes, where)
        # compression_level batch: rebuild the classic chunk from its zstd frames of items.
        magic, _, _, n, _, frames = _FRAMED.unpack_from(data)
        if magic != _FRAMED_MAGIC:
            raise ValueError(f"{where}: no LDFZ01 header, though the index says compression "
                             "level batch")
        offsets = np.frombuffer(data, "<u4", n + 1, _FRAMED.size).astype(np.int64)
        at = _FRAMED.size + 4 * (n + 1)
        body = []
        for f in range(frames):
            _, _, start, size, raw = _FRAME.unpack_from(data, at + f * _FRAME.size)
            body.append(decompress("zstd", data[start: start + size], raw, where))
        header = 4 * (n + 2)
        return b"".join([struct.pack("<I", n), (offsets + header).astype("<u4").tobytes(),
                         *body])

    def split(self, record: memoryview, where: str, shard: int, pos: int
              ) -> list[memoryview | bytes]:
        if not record and self._formats:
            return self._footer_row(shard, pos, where)
        if self._sample_codec is not None:
            record = memoryview(decompress(self._sample_codec, bytes(record), None, where))
        return split_sized(record, [None] * len(self._formats), where)

    def _footer_row(self, shard: int, pos: int, where: str) -> list[memoryview | bytes]:
        """The row of an Arrow footer, for a chunk that keeps its rows there."""
        import pyarrow as pa

        with self._footer_lock:
            table = self._footers.get(shard)
            if table is None:
                data = self.shard_bytes(shard)
                if bytes(data[-8:]) != _FOOTER_MAGIC:
                    raise ValueError(f"{where}: an empty item and no Arrow footer")
                size = struct.unpack_from("<I", data, len(data) - 12)[0]
                ipc = pa.py_buffer(bytes(data[len(data) - 12 - size: len(data) - 12]))
                if bytes(ipc[:6]) == b"ARROW1":
                    table = pa.ipc.open_file(ipc).read_all()
                else:
                    table = pa.ipc.open_stream(ipc).read_all()
                self._footers.put(shard, table)
        row = table.slice(pos, 1).to_pylist()[0]
        wanted = {f.column.name for f in self.fields}
        missing = sorted(wanted - row.keys())
        if missing:
            raise ValueError(f"{where}: the chunk's Arrow rows have no column {missing[0]!r}")
        return [_plain(row[c.name], c.encoding) if c.name in wanted else b""
                for c in self.columns]
