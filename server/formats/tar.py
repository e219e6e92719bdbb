"""`format: tar`: WebDataset-style shards, indexed once at open, members read with pread.

A sample is the members of one shard that share a key: the member's path up to the first '.'
of its file name (`a/b/0001.seg.png` -> key `a/b/0001`, extension `seg.png`). Only regular
files count; a file name without a '.', or starting with one, is not part of any sample.
Samples are in the order of their first member in the shard; shards in key order.

At open each shard's headers are walked with `tarfile` (no member data is read) into numpy
arrays: per sample, per configured field, the data offset and size in its shard (-1: absent).
A sample missing a configured field, or a member whose data runs past the end of a truncated
shard, fails when read (so `on_error: skip` can replace it); a damaged header stops the
server at open, since the members after it cannot be found. Shards must be uncompressed
(offsets are file offsets). For s3:// sources, opening fetches every shard into the disk cache.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from .._sampling import EpochKey
from ..images import image_pipeline
from ..sources import Storage
from ._shards import ShardIndex
from .memmap import OpenMaps

DEFAULT_PATTERN = "**/*.tar"  # a source that names a directory: every .tar file under it
BLOCK = tarfile.BLOCKSIZE


def split_member(name: str) -> tuple[str, str] | None:
    """`dir/0001.seg.png` -> (`dir/0001`, `seg.png`); None for names that are no sample's."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not stem or not dot or not ext:
        return None
    return (f"{folder}/{stem}" if folder else stem), ext


class _Fd:
    """A read-only file descriptor, closed when the last user lets go of it."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def __del__(self) -> None:
        if hasattr(self, "fd"):  # not when os.open failed
            os.close(self.fd)


class _Field:
    def __init__(self, name: str, cfg: Any) -> None:
        self.name = name
        self.ext = cfg.ext
        self.decode = cfg.decode
        self.pipeline = image_pipeline(cfg) if cfg.decode == "image" else None
        self.max_bytes = cfg.max_bytes
        if self.decode == "utf8" and self.max_bytes is None:
            raise ValueError(f"field {name!r}: decode utf8 needs max_bytes")
        if self.decode != "utf8" and self.max_bytes is not None:
            raise ValueError(f"field {name!r}: max_bytes applies to decode utf8 only")

    def convert(self, data: bytes, out: dict[str, Any], rng: np.random.Generator) -> None:
        if self.pipeline is not None:
            out[self.name] = self.pipeline(data, rng)
        elif self.decode == "int":
            out[self.name] = np.int64(int(data.decode("utf-8").strip()))
        elif self.decode == "float":
            out[self.name] = np.float64(float(data.decode("utf-8").strip()))
        elif self.decode == "npy":
            out[self.name] = np.load(io.BytesIO(data), allow_pickle=False)
        else:  # utf8: cut at a character boundary, zero-padded, as format: jsonl does
            data = data.decode("utf-8")[: self.max_bytes].encode("utf-8")
            if len(data) > self.max_bytes:
                data = data[: self.max_bytes].decode("utf-8", "ignore").encode("utf-8")
            text = np.zeros(self.max_bytes, np.uint8)
            text[: len(data)] = np.frombuffer(data, np.uint8)
            out[self.name] = text
            out[f"{self.name}_length"] = np.int64(len(data))


class Tar:
    """Thread-safe: __getitem__ reads immutable arrays and descriptors opened under a lock."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        self.storage = storage
        self.fields = [_Field(name, f) for name, f in cfg.fields.items()]
        names = [f.name for f in self.fields]
        extra = [f"{f.name}_length" for f in self.fields if f.decode == "utf8"]
        if len(set(names + extra)) != len(names) + len(extra):
            raise ValueError(f"output field names collide: {sorted(names + extra)}")
        exts = {f.ext: i for i, f in enumerate(self.fields)}
        infos = storage.list(pattern or DEFAULT_PATTERN)
        if not infos:
            raise ValueError(f"{storage.url}: no files match {pattern or DEFAULT_PATTERN!r}")
        keys: list[str] = []
        offsets: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        counts = []
        for o in infos:
            shard_keys, shard_offsets, shard_sizes = self._index(o.key, exts)
            keys += shard_keys
            offsets.append(shard_offsets)
            sizes.append(shard_sizes)
            counts.append(len(shard_keys))
        self.shards = ShardIndex(counts)
        self.length = self.shards.length
        if self.length == 0:
            raise ValueError(f"{storage.url}: no samples (members named KEY.EXT) in "
                             f"{len(infos)} shards")
        # Fixed-width numpy arrays, not lists of str: nothing for copy-on-write to touch.
        self.shard_keys = np.array([o.key for o in infos])
        self.keys = np.array([k.encode("utf-8") for k in keys])  # bytes: 1 byte a character
        self.offsets = np.concatenate(offsets)  # [samples, fields] int64
        self.sizes = np.concatenate(sizes)  # [samples, fields] int64, -1: no such member
        self.shard_starts = self.shards.shard_starts
        self._fds: OpenMaps[_Fd] = OpenMaps(storage, lambda key, path: _Fd(path))

    def _index(self, key: str, exts: dict[str, int]
               ) -> tuple[list[str], np.ndarray, np.ndarray]:
        """One shard's samples: keys, and per field the data offsets and sizes."""
        where = self.storage.where(key)
        path = self.storage.local_path(key)
        file_size = path.stat().st_size
        samples: dict[str, int] = {}  # key -> row, in order of first appearance
        rows: list[list[int]] = []  # per sample: offset, size for each field
        nf = len(self.fields)
        try:
            with tarfile.open(path, mode="r:") as tf:
                while True:
                    try:
                        member = tf.next()
                    except tarfile.ReadError as e:
                        # tarfile checks that a member's data is there before reading on:
                        # data cut short is found below and fails at read time.
                        if "unexpected end of data" in str(e):
                            break
                        raise
                    if member is None:
                        break
                    parts = split_member(member.name) if member.isreg() else None
                    if parts is None:
                        continue
                    row = samples.setdefault(parts[0], len(samples))
                    if row == len(rows):
                        rows.append([0, -1] * nf)
                    f = exts.get(parts[1])
                    if f is None:
                        continue
                    if rows[row][2 * f + 1] >= 0:
                        raise ValueError(f"{where}: member {member.name!r} appears twice")
                    rows[row][2 * f : 2 * f + 2] = [member.offset_data, member.size]
                end = tf.offset  # where tarfile stopped: the end marker, or EOF
        except tarfile.TarError as e:
            raise ValueError(f"{where}: not a readable uncompressed tar: {e}") from None
        if end < file_size:
            with open(path, "rb") as f:
                rest = os.pread(f.fileno(), BLOCK, end)
            # tarfile stops silently at a header it cannot parse: only zeros may follow.
            if rest.strip(b"\0"):
                raise ValueError(f"{where}: damaged tar header at byte {end}; the members "
                                 "after it cannot be found (truncated or corrupt shard)")
        table = np.array(rows, dtype=np.int64).reshape(len(rows), nf, 2)
        return list(samples), table[:, :, 0], table[:, :, 1]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.sample(index, EpochKey())

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        shard = str(self.shard_keys[self.shards.locate(index)[0]])
        rng = key.rng(index)  # shared by the image fields, in field order
        key = self.keys[index].decode("utf-8")
        out: dict[str, Any] = {}
        fd: _Fd | None = None
        for f, field in enumerate(self.fields):
            member = f"{key}.{field.ext}"
            size = int(self.sizes[index, f])
            if size < 0:
                raise ValueError(f"sample {key!r} has no member {member!r}")
            if fd is None:
                fd = self._fds.get(shard)
            data = self._pread(fd, size, int(self.offsets[index, f]))
            if len(data) < size:
                raise EOFError(f"member {member!r}: {len(data)} of {size} bytes at byte "
                               f"{int(self.offsets[index, f])}; the shard is truncated")
            try:
                field.convert(data, out, rng)
            except Exception as e:
                raise ValueError(f"member {member!r}: cannot decode {field.decode}: "
                                 f"{type(e).__name__}: {e}") from e
        return out

    @staticmethod
    def _pread(fd: _Fd, size: int, offset: int) -> bytes:
        data = os.pread(fd.fd, size, offset)
        if len(data) == size or not data:
            return data
        parts = [data]  # Linux reads at most ~2 GiB at once
        while size > (got := sum(map(len, parts))):
            more = os.pread(fd.fd, size - got, offset + got)
            if not more:
                break
            parts.append(more)
        return b"".join(parts)

    def source_of(self, index: int) -> str:
        shard = str(self.shard_keys[self.shards.locate(index)[0]])
        return f"{self.storage.where(shard)} member {self.keys[index].decode('utf-8')}.*"

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return self.shard_keys[self.shards.shards_of(indices)].tolist()
