"""`format: tfrecord`: TFRecord files of serialized `tf.train.Example`s, indexed once, records
read with pread and their CRCs checked.

A file is records one after another, each

    uint64 length (LE) | uint32 masked CRC32C of those 8 bytes | data | uint32 masked CRC32C

(TensorFlow's `tensorflow/core/lib/io/record_writer`). Sample i is the i-th record of the
files in sorted key order. At open each file's headers are walked (8 + 4 bytes a record, the
data skipped) into an offsets index, which is kept in `cache.dir/tfrecord/` (named by the
file's URL and version, written under a temp name and renamed, one process per file under a
lock), so that a restarted server, and every worker after the first, reads the index instead
of the file. A header whose CRC is wrong stops the server at open (the records after it
cannot be found); so does a file cut inside a header. A record whose data is cut short, or
whose data CRC is wrong, fails when read, naming the file, the record and its byte offset, so
that `on_error: skip` can replace it.

GZIP and ZLIB files (`compression:`, or by extension) are decompressed once, at open, into the
same folder and read from there like plain ones: random access needs offsets into the
uncompressed bytes (TensorFlow's reader, which only streams, does not). Where cache.dir cannot
be written they are held in memory, each worker its own copy (a warning says so).
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import re
import zlib
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from ..images import decode_version
from ..order.sampling import EpochKey
from ..sources import ObjectInfo, Storage
from ..sources.cache import LOCKS, TMP, file_lock
from ..sources.prefix_cache import use_cache
from ._contract import Sampled
from ._example import Feature, check_names, record_files, write_example
from ._shards import ShardIndex
from .memmap import OpenMaps

log = logging.getLogger("stoker.server")

# A source that names a directory: the files whose name says TFRecord (`x.tfrecord`,
# `train.tfrecord-00000-of-00128`, `x.tfrec.gz`...).
NAMED = re.compile(r"\.tfrec(ord)?s?($|[.-])", re.IGNORECASE)
HEADER = 12  # length and its CRC
FOOTER = 4  # the data's CRC
_MASK_DELTA = 0xA282EAD8
INDEX_VERSION = 1  # of the files in cache.dir/tfrecord/: a change makes new names


def masked_crc(data: bytes) -> int:
    """TensorFlow's masked CRC32C (crc32c.h: rotate right by 15, add a constant)."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def compression_of(key: str, configured: str) -> str:
    if configured != "auto":
        return configured
    lower = key.lower()
    if lower.endswith(".gz"):
        return "gzip"
    if lower.endswith((".zz", ".zlib")):
        return "zlib"
    return "none"


def index_file(path: Path, where: str) -> np.ndarray:
    """[records, 2] int64: each record's data offset and length, from its headers."""
    size = path.stat().st_size
    rows: list[tuple[int, int]] = []
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        at = 0
        while at < size:
            head = os.pread(fd, HEADER, at)
            if len(head) < HEADER:
                raise ValueError(f"{where}: truncated: record {len(rows)} at byte {at} has "
                                 f"{len(head)} of its {HEADER} header bytes")
            length = int.from_bytes(head[:8], "little")
            if masked_crc(head[:8]) != int.from_bytes(head[8:], "little"):
                hint = (" (gzip data: set compression: gzip)" if at == 0 and head[:2]
                        == b"\x1f\x8b" else " (compressed? set compression: gzip or zlib)"
                        if at == 0 else "")
                raise ValueError(f"{where}: record {len(rows)} at byte {at}: the length's "
                                 f"CRC does not match; the records after it cannot be "
                                 f"found (corrupt file){hint}")
            rows.append((at + HEADER, length))
            at += HEADER + length + FOOTER
    return np.array(rows, np.int64).reshape(len(rows), 2)


class _Files:
    """Each file's local path (a compressed one's decompressed copy) and offsets index,
    made once per file and version in `cache_dir/tfrecord` (see the module's docstring).
    Thread-safe after open."""

    def __init__(self, storage: Storage, cache_dir: Path | None,
                 compression: dict[str, str]) -> None:
        self.storage = storage
        self.compression = compression
        self._digests: dict[str, str] = {}  # key -> name of its files in the folder
        self.folder: Path | None = None
        self._memory: dict[str, int] = {}  # key -> memfd of a decompressed file
        if cache_dir is not None:
            folder = cache_dir / "tfrecord"
            try:
                for made in (folder, cache_dir / LOCKS):
                    made.mkdir(parents=True, exist_ok=True)
                if os.access(folder, os.W_OK):
                    self.folder = folder
            except OSError:
                pass
            if self.folder is None:
                log.warning("%s: cannot keep TFRecord indexes in %s; each worker indexes "
                            "(and decompresses) the files itself", storage.url, cache_dir)

    def __del__(self, _close: Any = os.close) -> None:
        for fd in getattr(self, "_memory", {}).values():
            _close(fd)

    def open_all(self, infos: list[ObjectInfo]) -> list[np.ndarray]:
        """Every file's index, in `infos` order: first those no other process is making,
        then the rest (waiting for them)."""
        found: dict[str, np.ndarray] = {}
        for wait in (False, True):
            for o in infos:
                if o.key not in found:
                    index = self._ensure(o, wait)
                    if index is not None:
                        found[o.key] = index
        return [found[o.key] for o in infos]

    def local_path(self, key: str) -> Path:
        """The file to read `key`'s records from; a decompressed copy that the disk cache
        evicted is made again (under its lock, as at open)."""
        if self.compression[key] == "none":
            return self.storage.local_path(key)
        if self.folder is None:
            return Path(f"/proc/self/fd/{self._memory[key]}")
        path = self._inflated(key)
        if not path.exists():
            digest = self._digests[key]
            with file_lock(self.folder.parent / LOCKS / f"tfrecord-{digest}", wait=True):
                if not path.exists():
                    self._write(path, self._inflate, key)
        return path

    def _inflated(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{self._digests[key]}.tfrecord"

    def _ensure(self, o: ObjectInfo, wait: bool) -> np.ndarray | None:
        """File `o`'s index, made (and the file decompressed) if missing; None without
        `wait` if another process is making it now."""
        where = self.storage.where(o.key)
        if self.folder is None:
            if self.compression[o.key] != "none" and o.key not in self._memory:
                fd = os.memfd_create("stoker-tfrecord", os.MFD_CLOEXEC)
                self._inflate(o.key, fd)
                self._memory[o.key] = fd
            return index_file(self.local_path(o.key), where)
        digest = self._digests[o.key] = hashlib.sha256(
            f"{self.storage.url}/{o.key}\0{o.version}\0{INDEX_VERSION}".encode()
        ).hexdigest()[:40]
        index = self.folder / f"{digest}.index.npy"
        if (found := self._load(index)) is not None:
            return found
        with file_lock(self.folder.parent / LOCKS / f"tfrecord-{digest}", wait=wait) as held:
            if not held:
                return None
            if (found := self._load(index)) is not None:  # made while we waited
                return found
            if self.compression[o.key] != "none" and not self._inflated(o.key).exists():
                self._write(self._inflated(o.key), self._inflate, o.key)
            table = index_file(self.local_path(o.key), where)
            self._write(index, _save, table)
            return table

    def _write(self, path: Path, fill: Any, *args: Any) -> None:
        """Write `path` through fill(*args, fd) under a temp name, then rename it."""
        tmp = path.with_name(f"{TMP}{os.getpid()}-{path.name}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                fill(*args, fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _load(path: Path) -> np.ndarray | None:
        try:
            os.utime(path)  # used: the disk cache evicts the least recently used files
            return np.load(path, allow_pickle=False)
        except (FileNotFoundError, ValueError, OSError):
            return None

    def _inflate(self, key: str, fd: int) -> None:
        """Write file `key`'s decompressed bytes into `fd`, streamed."""
        where = self.storage.where(key)
        kind = self.compression[key]
        try:
            with open(self.storage.local_path(key), "rb") as src, \
                    open(fd, "wb", closefd=False) as dst:
                if kind == "gzip":
                    with gzip.open(src, "rb") as inflated:
                        while chunk := inflated.read(1 << 20):
                            dst.write(chunk)
                    return
                z = zlib.decompressobj()
                while chunk := src.read(1 << 20):
                    dst.write(z.decompress(chunk))
                dst.write(z.flush())
                if not z.eof:
                    raise EOFError("the zlib stream ends early")
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{where}: not a readable {kind.upper()} file: "
                             f"{type(e).__name__}: {e}") from None


def _save(table: np.ndarray, fd: int) -> None:
    with open(fd, "wb", closefd=False) as f:
        np.save(f, table)


class _Fd:
    """A read-only file descriptor, closed when the last user lets go of it."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def __del__(self, _close: Any = os.close) -> None:  # os may be gone at interpreter exit
        if hasattr(self, "fd"):
            _close(self.fd)


class Tfrecord(Sampled):
    """Thread-safe: sample() reads immutable arrays and descriptors opened under a lock."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.storage = storage
        self.sequence = cfg.record == "sequence_example"
        self.fields = [Feature(name, f) for name, f in cfg.features.items()]
        check_names(self.fields)
        infos = record_files(storage, pattern, NAMED, "*.tfrecord*, *.tfrec*")
        compression = {o.key: compression_of(o.key, cfg.compression) for o in infos}
        self._files = _Files(storage, Path(cache_dir) if cache_dir is not None else None,
                             compression)
        indexes = self._files.open_all(infos)
        self.shards = ShardIndex([len(i) for i in indexes])
        self.length = self.shards.length
        if self.length == 0:
            raise ValueError(f"{storage.url}: no records in {len(infos)} files")
        self.shard_keys = np.array([o.key for o in infos])
        table = np.concatenate(indexes)
        self.offsets = np.ascontiguousarray(table[:, 0])
        self.lengths = np.ascontiguousarray(table[:, 1])
        self.shard_starts = self.shards.shard_starts
        self._fds: OpenMaps[_Fd] = OpenMaps(self._files,  # type: ignore[arg-type]
                                            lambda key, path: _Fd(path))

    def record(self, index: int) -> bytes:
        """Record `index`'s data, its CRC checked."""
        shard, position = self.shards.locate(index)
        key = str(self.shard_keys[shard])
        offset, length = int(self.offsets[index]), int(self.lengths[index])
        fd = self._fds.get(key)
        # Two reads, not one sliced: a slice of the record copies it (twice: checked and
        # returned), which cost a large photo's record more than the read (0.1 ms a copy).
        data = os.pread(fd.fd, length, offset)
        footer = os.pread(fd.fd, FOOTER, offset + length)
        if len(data) + len(footer) < length + FOOTER:
            raise EOFError(f"{self.storage.where(key)} record {position}: "
                           f"{len(data) + len(footer)} of {length + FOOTER} bytes at byte "
                           f"{offset}; the file is truncated")
        if masked_crc(data) != int.from_bytes(footer, "little"):
            raise ValueError(f"{self.storage.where(key)} record {position} at byte "
                             f"{offset - HEADER}: the data's CRC does not match (corrupt)")
        return data

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        rng = key.rng(index)  # shared by the image fields, in field order
        out: dict[str, Any] = {}
        prefixes = [f.pipeline.cached(index) if f.pipeline is not None else None
                    for f in self.fields]
        return write_example(self.fields, prefixes, lambda: self.record(index), self.sequence,
                             out, rng, index)

    def decode_version(self) -> str:
        return decode_version([f.pipeline for f in self.fields])

    def use_prefix_cache(self, scope: Any) -> None:
        use_cache(scope, [(f.name, f.pipeline) for f in self.fields])

    def source_of(self, index: int) -> str:
        shard, position = self.shards.locate(index)
        return f"{self.storage.where(str(self.shard_keys[shard]))} record {position}"

    def place_of(self, index: int) -> dict[str, Any]:
        """Its file, its record number in it, and the record's bytes (header to CRC) in the
        (decompressed) file."""
        shard, position = self.shards.locate(index)
        return {"file": self.storage.where(str(self.shard_keys[shard])), "record": position,
                "offset": int(self.offsets[index]) - HEADER,
                "nbytes": HEADER + int(self.lengths[index]) + FOOTER}

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return self.shard_keys[self.shards.shards_of(indices)].tolist()
