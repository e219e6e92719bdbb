"""`format: memmap`: arrays whose first axis is the sample, memory-mapped, never read whole.

Each configured field names a glob under the source directory; that field's files, sorted by
key, are concatenated along axis 0, and every field must have the same number of rows. Sample
i is row i of every field, copied out of the map (writable, and it does not pin the file).

Files ending in `.npy` are NumPy's own format. Any other file is stoker's raw array format:

    offset  size     content
    0       8        magic b"STKRARR1"
    8       4        uint32 LE: data offset, a multiple of 64, >= 32 + 8 * ndim
    12      4        uint32 LE: ndim, 1 to 32
    16      16       dtype as NumPy writes it (`dtype.str`: "<f4", "|u1", "|b1"), ASCII, NUL-padded
    32      8*ndim   shape, uint64 LE each
    ...              zero bytes up to the data offset
    offset  rest     the elements in C order, in the dtype's byte order; nothing after them

`write_array` (little-endian always) and `read_header` produce and read it with NumPy alone.
Only headers are read at open (a few ranged reads: for s3:// sources nothing is downloaded
yet); a file is mapped on first use, through the storage's local file.
"""

from __future__ import annotations

import io
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from .._lru import LRU
from ..sources import Storage
from ._shards import ShardIndex

MAGIC = b"STKRARR1"
ALIGN = 64
MAX_NDIM = 32
_FIXED = struct.Struct("<8sII16s")  # magic, data offset, ndim, dtype string
HEADER_MAX = _FIXED.size + 8 * MAX_NDIM  # bytes that always hold a whole header
NUMBER_KINDS = "biuf"  # what a batch can carry (see _batch._as_array)

T = TypeVar("T")


@dataclass(frozen=True)
class ArrayHeader:
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # where the data starts
    fortran_order: bool = False  # .npy only

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def write_array(path: str | os.PathLike[str], array: Any) -> ArrayHeader:
    """Write `array` (ndim >= 1, bool/int/float) in stoker's raw format, little-endian."""
    arr = np.asarray(array)
    if arr.ndim < 1 or arr.ndim > MAX_NDIM:
        raise ValueError(f"ndim must be 1 to {MAX_NDIM}, got {arr.ndim}")
    if arr.dtype.kind not in NUMBER_KINDS:
        raise ValueError(f"dtype {arr.dtype} is not bool, int or float")
    dtype = arr.dtype.newbyteorder("<")
    arr = np.ascontiguousarray(arr, dtype=dtype)
    offset = -(-(_FIXED.size + 8 * arr.ndim) // ALIGN) * ALIGN
    head = _FIXED.pack(MAGIC, offset, arr.ndim, dtype.str.encode("ascii"))
    head += struct.pack(f"<{arr.ndim}Q", *arr.shape)
    with open(path, "wb") as f:
        f.write(head.ljust(offset, b"\0"))
        arr.tofile(f)
    return ArrayHeader(dtype, arr.shape, offset)


def parse_header(data: bytes, where: str) -> ArrayHeader:
    """The header at the start of a raw array file (`data`: its first bytes, enough of them)."""
    if len(data) < _FIXED.size or data[:8] != MAGIC:
        raise ValueError(f"{where}: not a stoker array (no {MAGIC.decode()} magic; .npy files "
                         "must end in .npy)")
    _, offset, ndim, dtype_str = _FIXED.unpack_from(data)
    if not 1 <= ndim <= MAX_NDIM:
        raise ValueError(f"{where}: bad header: ndim {ndim} not in 1..{MAX_NDIM}")
    if offset % ALIGN or offset < _FIXED.size + 8 * ndim:
        raise ValueError(f"{where}: bad header: data offset {offset}")
    if len(data) < _FIXED.size + 8 * ndim:
        raise ValueError(f"{where}: bad header: file ends inside it")
    try:
        dtype = np.dtype(dtype_str.rstrip(b"\0").decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError):
        raise ValueError(f"{where}: bad header: dtype {dtype_str!r}") from None
    shape = struct.unpack_from(f"<{ndim}Q", data, _FIXED.size)
    return ArrayHeader(dtype, tuple(int(n) for n in shape), offset)


def read_header(path: str | os.PathLike[str]) -> ArrayHeader:
    """The header of a raw array file that `write_array` wrote."""
    with open(path, "rb") as f:
        return parse_header(f.read(HEADER_MAX), str(path))


def _npy_header(storage: Storage, key: str, size: int) -> ArrayHeader:
    where = storage.where(key)
    first = storage.read_range(key, 0, min(size, 16))
    if len(first) < 10 or first[:6] != b"\x93NUMPY":
        raise ValueError(f"{where}: not a .npy file")
    major = first[6]
    if major == 1:
        end = 10 + struct.unpack_from("<H", first, 8)[0]
    elif major in (2, 3) and len(first) >= 12:
        end = 12 + struct.unpack_from("<I", first, 8)[0]
    else:
        raise ValueError(f"{where}: unsupported .npy version {major}")
    if end > size:
        raise ValueError(f"{where}: .npy header runs past the end of the file")
    f = io.BytesIO(storage.read_range(key, 0, end))
    try:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read(f, max_header_size=end)
    except ValueError as e:
        raise ValueError(f"{where}: bad .npy header: {e}") from None
    return ArrayHeader(np.dtype(dtype), tuple(shape), end, bool(fortran))


class OpenMaps(Generic[T]):
    """Memory maps opened on first use, at most `limit` at once (least recently used dropped
    first): each holds a file descriptor, and for s3:// sources a disk-cache file that
    eviction could otherwise not reclaim. Thread-safe."""

    def __init__(self, storage: Storage, opener: Callable[[str, Path], T],
                 limit: int = 128) -> None:
        self.storage = storage
        self.opener = opener
        self._maps: LRU[str, T] = LRU(max_items=limit)
        self._lock = threading.Lock()

    def get(self, key: str) -> T:
        with self._lock:
            # Under the lock: two threads never map (or, for s3, fetch) one file twice. The
            # evicted are unmapped when their last row view is gone.
            return self._maps.get_or_make(
                key, lambda: self.opener(key, self.storage.local_path(key)))


class _Field:
    """One field's files: keys, headers, and which file holds each row."""

    def __init__(self, name: str, storage: Storage, pattern: str) -> None:
        infos = storage.list(pattern)
        if not infos:
            raise ValueError(f"{storage.url}: field {name!r}: no files match {pattern!r}")
        self.headers: list[ArrayHeader] = []
        for o in infos:
            where = storage.where(o.key)
            if o.size == 0:
                raise ValueError(f"{where}: empty file")
            if o.key.endswith(".npy"):
                h = _npy_header(storage, o.key, o.size)
            else:
                h = parse_header(storage.read_range(o.key, 0, min(o.size, HEADER_MAX)), where)
            if h.dtype.kind not in NUMBER_KINDS or h.dtype.hasobject:
                raise ValueError(f"{where}: dtype {h.dtype} is not bool, int or float")
            if not h.shape:
                raise ValueError(f"{where}: a 0-d array has no rows")
            if o.size != h.offset + h.nbytes:
                raise ValueError(f"{where}: {o.size} bytes, but its header says "
                                 f"{h.offset + h.nbytes} ({h.dtype.str}{list(h.shape)})")
            first = self.headers[0] if self.headers else h
            if h.dtype != first.dtype or h.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"{where}: rows are {h.dtype.str}{list(h.shape[1:])}, but "
                    f"{storage.where(infos[0].key)}'s are {first.dtype.str}{list(first.shape[1:])}")
            self.headers.append(h)
        # Fixed-width numpy arrays, not lists of str: nothing for copy-on-write to touch.
        self.keys = np.array([o.key for o in infos])
        self.files = ShardIndex([h.shape[0] for h in self.headers])


class Memmap:
    """Thread-safe: __getitem__ reads immutable arrays and maps opened under a lock."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        if pattern is not None:
            raise ValueError(f"{cfg.source}: a memmap source is a directory; each field gives "
                             "its own glob under it")
        self.storage = storage
        self.fields = {name: _Field(name, storage, glob) for name, glob in cfg.fields.items()}
        lengths = {name: f.files.length for name, f in self.fields.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{storage.url}: fields have different lengths: {lengths}")
        self.length = next(iter(lengths.values()))
        if self.length == 0:
            raise ValueError(f"{storage.url}: no rows in any file")
        self.shard_starts = next(iter(self.fields.values())).files.shard_starts
        self._maps: OpenMaps[np.ndarray] = OpenMaps(storage, self._open)
        self._header = {str(k): h for f in self.fields.values()
                        for k, h in zip(f.keys, f.headers, strict=True)}

    def _open(self, key: str, path: Path) -> np.ndarray:
        h = self._header[key]
        if key.endswith(".npy"):
            arr = np.load(path, mmap_mode="r")
            if arr.dtype != h.dtype or arr.shape != h.shape:
                raise ValueError(f"{self.storage.where(key)}: changed since the server started")
            return arr
        return np.memmap(path, h.dtype, "r", h.offset, h.shape)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} not in [0, {self.length})")
        out = {}
        for name, f in self.fields.items():
            k, row = f.files.locate(index)
            out[name] = np.array(self._maps.get(str(f.keys[k]))[row])
        return out

    def source_of(self, index: int) -> str:
        parts = []
        for f in self.fields.values():
            k, row = f.files.locate(index)
            parts.append(f"{self.storage.where(str(f.keys[k]))} row {row}")
        return ", ".join(dict.fromkeys(parts))

    def objects_of(self, indices: np.ndarray) -> list[str]:
        keys: dict[str, None] = {}
        for f in self.fields.values():
            keys.update(dict.fromkeys(f.keys[f.files.shards_of(indices)].tolist()))
        return list(keys)
