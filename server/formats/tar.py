"""`format: tar`: WebDataset-style shards, indexed once at open, members read with pread.

A sample is the members of one shard that share a key: the member's path up to the first '.'
of its file name (`a/b/0001.seg.png` -> key `a/b/0001`, extension `seg.png`), as webdataset
splits it. Extensions are matched ignoring case (webdataset lowercases them: `0001.JPG` is
its sample's `jpg`); keys keep their case. Only regular files count; a file name without a
'.', or starting with one, and webdataset's metadata names (`__*__`), are no sample's.
Samples are in the order of their first member in the shard; shards in key order.

At open each shard's headers are walked with `tarfile` (no member data is read) into numpy
arrays: per sample, per configured extension, the data offset and size in its shard (-1:
absent). Several fields may read one member (two `decode: json` paths of one `.json`); it is
read once. A sample missing a configured member, or a member whose data runs past the end of
a truncated shard, fails when read (so `on_error: skip` can replace it); a damaged header
stops the server at open, since the members after it cannot be found.

Gzipped shards (`.tar.gz`, `.tgz`) are decompressed once, at open, into `cache.dir/tar/`
(named by the shard's URL and version, written under a temp name and renamed, one process per
shard under a lock; workers take different shards first), and read from there like plain
ones: random access needs offsets into the uncompressed bytes, and a disk copy is shared by
every worker and kept across restarts, where a copy in memory would cost the whole dataset's
uncompressed size in every worker. Only where cache.dir cannot be written are they held in
memory (each worker its own copy; a warning says so). For s3:// sources, opening fetches
every shard into the disk cache.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..images import Prefix, decode_version, image_pipeline
from ..order.sampling import EpochKey
from ..sources import ObjectInfo, Storage
from ..sources.cache import LOCKS, TMP, file_lock
from ..sources.prefix_cache import use_cache
from . import jsonl
from ._shards import ShardIndex
from .memmap import OpenMaps

log = logging.getLogger("stoker.server")

# A source that names a directory: every shard under it, plain or gzipped.
DEFAULT_PATTERN = "**/*"
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # matched ignoring case
GZIP_SUFFIXES = (".tar.gz", ".tgz")
BLOCK = tarfile.BLOCKSIZE
# webdataset's tar_file_iterator skips members whose path matches this (metadata).
META = re.compile(r"__[^/]*__($|/)")


def split_member(name: str) -> tuple[str, str] | None:
    """`dir/0001.seg.PNG` -> (`dir/0001`, `seg.png`); None for names that are no sample's."""
    if META.match(name) or ("/" not in name and name.startswith("__")
                            and name.endswith("__")):
        return None
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not stem or not dot or not ext:
        return None
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def is_gzipped(key: str) -> bool:
    return key.lower().endswith(GZIP_SUFFIXES)


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
        self.ext = cfg.ext.lower()
        self.decode = cfg.decode
        self.pipeline = image_pipeline(cfg) if cfg.decode == "image" else None
        self.clip = None
        if cfg.decode == "video":  # imported here: PyAV only where a field decodes video
            from .video import ClipOfBytes

            self.clip = ClipOfBytes(cfg)
        self.max_bytes = cfg.max_bytes
        self.json = None
        self.path: tuple[str, ...] = ()
        if self.decode == "json":
            # jsonl's conversion of a value to dtype and shape; the path is ours: a member
            # is its own document, so no path means all of it.
            self.json = jsonl._Field(name, SimpleNamespace(
                path=cfg.path, dtype=cfg.dtype, shape=cfg.shape, max_bytes=cfg.max_bytes))
            self.path = tuple(cfg.path.split(".")) if cfg.path else ()
        elif self.decode == "utf8" and self.max_bytes is None:
            raise ValueError(f"field {name!r}: decode utf8 needs max_bytes")
        elif self.decode != "utf8" and self.max_bytes is not None:
            raise ValueError(f"field {name!r}: max_bytes applies to decode utf8 only")

    def output_names(self) -> list[str]:
        if self.pipeline is not None:
            return self.pipeline.output_names(self.name)
        if self.clip is not None:
            return self.clip.output_names(self.name)
        utf8 = self.decode == "utf8" or (self.json is not None and self.json.utf8)
        return [self.name, f"{self.name}_length"] if utf8 else [self.name]

    def convert(self, data: bytes | None, out: dict[str, Any], rng: np.random.Generator,
                parsed: dict[int, Any], index: int, prefix: Prefix | None = None) -> None:
        """Decode `data` into `out`; `parsed` holds JSON documents already parsed, by member
        id, for fields that read the same member. `prefix`: an image's cached prefix (then
        `data` is None)."""
        if self.pipeline is not None:
            self.pipeline.write(out, self.name, data, rng, index, prefix)
            return
        assert data is not None  # only an image's cached prefix comes without its bytes
        if self.clip is not None:
            self.clip.write(out, self.name, data, rng)
        elif self.json is not None:
            if id(data) not in parsed:
                parsed[id(data)] = json.loads(data)
            value = parsed[id(data)]
            if self.path:
                value = self.json.lookup(value)
            self.json.convert(value, out)
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


class _Gunzipped:
    """Where each gzipped shard's uncompressed copy is (see the module's docstring); the
    `local_path` of every other shard is the storage's. Thread-safe."""

    def __init__(self, storage: Storage, cache_dir: Path | None) -> None:
        self.storage = storage
        self.folder: Path | None = None
        self.infos: dict[str, ObjectInfo] = {}
        self._memory: dict[str, int] = {}  # key -> memfd, where the folder cannot be used
        if cache_dir is not None:
            self.folder = self._folder(cache_dir)

    def __del__(self) -> None:
        for fd in getattr(self, "_memory", {}).values():
            os.close(fd)

    def _folder(self, cache_dir: Path) -> Path | None:
        """cache_dir/tar, made if missing; None (with a warning) where it cannot be written."""
        folder = cache_dir / "tar"
        why = "not writable"
        try:
            for made in (folder, cache_dir / LOCKS):
                made.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError as e:
            why = str(e)
        log.warning("%s: cannot keep decompressed shards in %s (%s); each worker holds them "
                    "in memory", self.storage.url, cache_dir, why)
        return None

    def open_all(self, infos: list[ObjectInfo]) -> None:
        """Decompress every gzipped shard not yet decompressed: first those no other process
        is decompressing, then wait for the rest."""
        todo = [o for o in infos if is_gzipped(o.key)]
        self.infos.update((o.key, o) for o in todo)
        for wait in (False, True):
            todo = [o for o in todo if self._ensure(o, wait) is None]

    def local_path(self, key: str) -> Path:
        if key not in self.infos:
            return self.storage.local_path(key)
        path = self._ensure(self.infos[key], wait=True)
        assert path is not None
        return path

    def _ensure(self, o: ObjectInfo, wait: bool) -> Path | None:
        """The uncompressed copy of shard `o`; None without `wait` if another process is
        making it now."""
        if self.folder is None:
            if o.key not in self._memory:
                fd = os.memfd_create("stoker-tar", os.MFD_CLOEXEC)
                self._gunzip(o.key, fd)
                self._memory[o.key] = fd
            return Path(f"/proc/self/fd/{self._memory[o.key]}")
        digest = hashlib.sha256(f"{self.storage.url}/{o.key}\0{o.version}".encode()
                                ).hexdigest()[:40]
        path = self.folder / f"{digest}.tar"
        if self._touch(path):
            return path
        with file_lock(self.folder.parent / LOCKS / f"tar-{digest}", wait=wait) as held:
            if not held:
                return None
            if self._touch(path):  # made while we waited
                return path
            tmp = self.folder / f"{TMP}{os.getpid()}-{digest}.tar"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    self._gunzip(o.key, fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        return path

    @staticmethod
    def _touch(path: Path) -> bool:
        """Whether `path` exists; marks it used (the disk cache evicts the least recently
        used files of its folder, this one's included)."""
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    def _gunzip(self, key: str, fd: int) -> None:
        """Write shard `key`'s uncompressed bytes into `fd`, streamed: memory stays small."""
        where = self.storage.where(key)
        try:
            with gzip.open(self.storage.local_path(key), "rb") as src, \
                    open(fd, "wb", closefd=False) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise ValueError(f"{where}: not a readable gzip file: {type(e).__name__}: {e}"
                             ) from None


class Tar:
    """Thread-safe: __getitem__ reads immutable arrays and descriptors opened under a lock."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.storage = storage
        self.fields = [_Field(name, f) for name, f in cfg.fields.items()]
        names = [n for f in self.fields for n in f.output_names()]
        if len(set(names)) != len(names):
            raise ValueError(f"output field names collide: {sorted(names)}")
        # The members a sample is read from: one per distinct extension, in field order.
        self.exts = list(dict.fromkeys(f.ext for f in self.fields))
        self.member_of = [self.exts.index(f.ext) for f in self.fields]
        exts = {ext: i for i, ext in enumerate(self.exts)}
        infos = storage.list(pattern or DEFAULT_PATTERN)
        if pattern is None:
            infos = [o for o in infos if o.key.lower().endswith(SHARD_SUFFIXES)]
        if not infos:
            raise ValueError(f"{storage.url}: no files match "
                             f"{pattern or '**/*.tar, **/*.tar.gz, **/*.tgz'!r}")
        self._paths = _Gunzipped(storage, Path(cache_dir) if cache_dir is not None else None)
        self._paths.open_all(infos)
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
        # Paths from _paths: a gzipped shard's is its uncompressed copy.
        self._fds: OpenMaps[_Fd] = OpenMaps(self._paths,  # type: ignore[arg-type]
                                            lambda key, path: _Fd(path))

    def _index(self, key: str, exts: dict[str, int]
               ) -> tuple[list[str], np.ndarray, np.ndarray]:
        """One shard's samples: keys, and per member the data offsets and sizes."""
        where = self.storage.where(key)
        path = self._paths.local_path(key)
        file_size = path.stat().st_size
        samples: dict[str, int] = {}  # key -> row, in order of first appearance
        rows: list[list[int]] = []  # per sample: offset, size for each member
        nf = len(self.exts)
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
            raise ValueError(f"{where}: not a readable tar: {e}") from None
        if end < file_size:
            with open(path, "rb") as fh:
                rest = os.pread(fh.fileno(), BLOCK, end)
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
        members: dict[int, bytes] = {}
        parsed: dict[int, Any] = {}
        for field, m in zip(self.fields, self.member_of, strict=True):
            member = f"{key}.{field.ext}"
            prefix = field.pipeline.cached(index) if field.pipeline is not None else None
            if prefix is None and m not in members:
                size = int(self.sizes[index, m])
                if size < 0:
                    raise ValueError(f"sample {key!r} has no member {member!r}")
                if fd is None:
                    fd = self._fds.get(shard)
                members[m] = self._pread(fd, size, int(self.offsets[index, m]))
                if len(members[m]) < size:
                    raise EOFError(f"member {member!r}: {len(members[m])} of {size} bytes at "
                                   f"byte {int(self.offsets[index, m])}; the shard is "
                                   "truncated")
            try:
                field.convert(members.get(m), out, rng, parsed, index, prefix)
            except Exception as e:
                raise ValueError(f"member {member!r}: cannot decode {field.decode}: "
                                 f"{type(e).__name__}: {e}") from e
        return out

    def decode_version(self) -> str:
        return decode_version([f.pipeline for f in self.fields])

    def use_prefix_cache(self, scope: Any) -> None:
        use_cache(scope, [(f.name, f.pipeline) for f in self.fields])

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

    def place_of(self, index: int) -> dict[str, Any]:
        """Its shard and its first member's data: offset and size in the (uncompressed)
        tar stream."""
        shard = str(self.shard_keys[self.shards.locate(index)[0]])
        place: dict[str, Any] = {"file": self.storage.where(shard)}
        for m, ext in enumerate(self.exts):
            if int(self.sizes[index, m]) >= 0:
                place.update(member=f"{self.keys[index].decode('utf-8')}.{ext}",
                             offset=int(self.offsets[index, m]),
                             nbytes=int(self.sizes[index, m]))
                break
        return place

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return self.shard_keys[self.shards.shards_of(indices)].tolist()
