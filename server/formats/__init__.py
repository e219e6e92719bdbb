"""Dataset formats: each turns a `format:` block of the config into a map-style dataset.

A format object has:
- `__len__()` and `__getitem__(i) -> dict[str, numpy array | numpy scalar]`;
- `source_of(i) -> str`: where sample i comes from, for error messages (file or object URL,
  and the line, tar member or row inside it);
- optionally `shard_starts`: an int64 array, ascending, starting at 0, of the first sample of
  each shard (file, tar shard, row group), which `shuffle: block` permutes;
- optionally `objects_of(indices) -> list[str]`: the storage keys those samples read, which the
  server fetches ahead of time (see sources/prefetch.py).
Formats read bytes only through a `Storage` (see sources/), never by opening paths themselves.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..sources import Storage, open_storage, split_source


class MapDataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> dict[str, Any]: ...


def open_dataset(name: str, config: Any, cache: Any = None) -> MapDataset:
    """Open dataset `name` of a validated Config (in the calling process). `cache` is the
    process's DiskCache (needed for s3:// sources)."""
    cfg = config.datasets[name]
    if cfg.format == "python":
        from .python import open_python

        return open_python(cfg)
    root, pattern = split_source(cfg.source)
    storage: Storage = open_storage(root, config.s3_for(name), cache,
                                    int(config.cache.prefetch_bytes))
    if cfg.format == "image-folder":
        from .image_folder import ImageFolder

        return ImageFolder(cfg, storage, pattern)
    if cfg.format == "jsonl":
        from .jsonl import Jsonl

        return Jsonl(cfg, storage, pattern)
    if cfg.format == "tokens":
        from .tokens import Tokens

        return Tokens(cfg, storage, pattern)
    if cfg.format == "memmap":
        from .memmap import Memmap

        return Memmap(cfg, storage, pattern)
    if cfg.format == "tar":
        from .tar import Tar

        return Tar(cfg, storage, pattern)
    if cfg.format == "parquet":
        from .parquet import Parquet

        return Parquet(cfg, storage, pattern)
    raise ValueError(f"unknown format {cfg.format!r}")
