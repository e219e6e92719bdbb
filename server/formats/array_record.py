"""`format: array_record`: Grain's ArrayRecord files, read record by record through the
`array-record` package's reader (the `array-record` extra).

Sample i is the i-th record of the files in sorted key order. Each file's record count comes
from its footer at open; a reader is opened per file on first use, for random access
(`readahead_buffer_size:0`, no read-ahead threads), at most 128 at once. Records are
serialized `tf.train.Example`s read through `features:` (as in `format: tfrecord`), or raw
bytes decoded as `decode:` says. ArrayRecord's chunks carry their own checksums (Riegeli):
a damaged one fails when read, naming the file and the record.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..images import decode_version
from ..order.sampling import EpochKey
from ..sources import Storage
from ..sources.prefix_cache import use_cache
from ._contract import Sampled
from ._example import (
    Feature,
    RecordBytes,
    check_names,
    record_files,
    write_bytes,
    write_example,
)
from ._shards import ShardIndex
from .memmap import OpenMaps

# A source that names a directory: `x.array_record`, `train.array_record-00000-of-00016`.
NAMED = re.compile(r"\.array_?record($|-)", re.IGNORECASE)
RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"


def _reader_class() -> Any:
    try:
        from array_record.python.array_record_module import ArrayRecordReader
    except ImportError as e:
        raise ValueError("format: array_record needs the array-record package "
                         "(pip install 'stoker[array-record]')") from e
    return ArrayRecordReader


class _File:
    """One file's reader and the lock its reads take (one reader is not shared by threads:
    its Riegeli reader keeps a position)."""

    def __init__(self, path: Path, where: str) -> None:
        try:
            self.reader = _reader_class()(str(path), RANDOM_ACCESS)
        except (RuntimeError, ValueError, OSError) as e:
            raise ValueError(f"{where}: not a readable ArrayRecord file: {e}") from None
        self.lock = threading.Lock()

    def __del__(self) -> None:
        if hasattr(self, "reader"):
            self.reader.close()


class ArrayRecord(Sampled):
    """Thread-safe: sample() reads immutable arrays; each file's reads hold its lock."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        self.storage = storage
        self.sequence = cfg.record == "sequence_example"
        self.raw = RecordBytes(cfg.field, cfg) if cfg.features is None else None
        self.fields = ([Feature(n, f) for n, f in cfg.features.items()]
                       if cfg.features is not None else [])
        check_names(self.fields or [self.raw])
        infos = record_files(storage, pattern, NAMED, "*.array_record*")
        self._files: OpenMaps[_File] = OpenMaps(
            storage, lambda key, path: _File(path, storage.where(key)))
        counts = [self._files.get(o.key).reader.num_records() for o in infos]
        self.shards = ShardIndex(counts)
        self.length = self.shards.length
        if self.length == 0:
            raise ValueError(f"{storage.url}: no records in {len(infos)} files")
        self.shard_keys = np.array([o.key for o in infos])
        self.shard_starts = self.shards.shard_starts

    def record(self, index: int) -> bytes:
        shard, position = self.shards.locate(index)
        key = str(self.shard_keys[shard])
        file = self._files.get(key)
        try:
            with file.lock:
                return file.reader.read([position])[0]
        except (RuntimeError, ValueError, OSError) as e:
            raise ValueError(f"{self.storage.where(key)} record {position}: cannot read: "
                             f"{e}") from None

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        rng = key.rng(index)
        out: dict[str, Any] = {}
        if self.raw is not None:
            pipeline = self.raw.pipeline
            prefix = pipeline.cached(index) if pipeline is not None else None
            if pipeline is not None and prefix is not None:
                pipeline.write(out, self.raw.name, None, rng, index, prefix)
            else:
                data = self.record(index)
                try:
                    write_bytes(self.raw, out, data, rng, index)
                except Exception as e:
                    raise ValueError(f"field {self.raw.name!r}: cannot decode "
                                     f"{self.raw.decode}: {type(e).__name__}: {e}") from e
            return out
        prefixes = [f.pipeline.cached(index) if f.pipeline is not None else None
                    for f in self.fields]
        return write_example(self.fields, prefixes, lambda: self.record(index), self.sequence,
                             out, rng, index)

    def decode_version(self) -> str:
        return decode_version([self.raw.pipeline] if self.raw is not None
                              else [f.pipeline for f in self.fields])

    def use_prefix_cache(self, scope: Any) -> None:
        use_cache(scope, [(self.raw.name, self.raw.pipeline)] if self.raw is not None
                  else [(f.name, f.pipeline) for f in self.fields])

    def source_of(self, index: int) -> str:
        shard, position = self.shards.locate(index)
        return f"{self.storage.where(str(self.shard_keys[shard]))} record {position}"

    def place_of(self, index: int) -> dict[str, Any]:
        shard, position = self.shards.locate(index)
        return {"file": self.storage.where(str(self.shard_keys[shard])), "record": position}

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return self.shard_keys[self.shards.shards_of(indices)].tolist()

