"""Dataset formats: each turns a `format:` block of the config into a map-style dataset.

A format object has:
- `__len__()` and `__getitem__(i) -> dict[str, numpy array | numpy scalar]`;
- optionally `sample(i, key) -> dict`, which the server calls instead of `__getitem__` with
  the batch's EpochKey (seed, epoch, shuffle): for augmentation (`key.rng(i)`) and packing;
- `source_of(i) -> str`: where sample i comes from, for error messages (file or object URL,
  and the line, tar member or row inside it);
- optionally `shard_starts`: an int64 array, ascending, starting at 0, of the first sample of
  each shard (file, tar shard, row group), which `shuffle: block` permutes;
- optionally `objects_of(indices) -> list[str]`: the storage keys those samples read, which the
  server fetches ahead of time (see sources/prefetch.py).
Formats read bytes only through a `Storage` (see sources/), never by opening paths themselves.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from ..sources import Storage, open_storage, split_source


class MapDataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> dict[str, Any]: ...


# format -> (module, class): imported on use, so a server imports only the codecs it serves.
_READERS = {"image-folder": ("image_folder", "ImageFolder"), "jsonl": ("jsonl", "Jsonl"),
            "tokens": ("tokens", "Tokens"), "memmap": ("memmap", "Memmap"),
            "tar": ("tar", "Tar"), "parquet": ("parquet", "Parquet"),
            "text": ("text", "Text")}


def open_dataset(name: str, config: Any, cache: Any = None) -> MapDataset:
    """Open dataset `name` of a validated Config (in the calling process). `cache` is the
    process's DiskCache (needed for s3:// sources)."""
    cfg = config.datasets[name]
    if cfg.format == "python":
        from .python import open_python

        dataset = open_python(cfg)
    else:
        root, pattern = split_source(cfg.source)
        storage: Storage = open_storage(root, config.s3_for(name), cache,
                                        int(config.cache.prefetch_bytes),
                                        cfg.follow_symlinks_outside_root)
        module, cls = _READERS[cfg.format]
        reader = getattr(importlib.import_module(f".{module}", __name__), cls)
        # text keeps its tokenized corpus in the cache folder, shared by the workers.
        extra = {"cache_dir": config.cache.dir} if cfg.format == "text" else {}
        dataset = reader(cfg, storage, pattern, **extra)
    if cfg.transform is not None:
        from .python import WithTransform

        dataset = WithTransform(dataset, cfg.transform)
    return dataset
