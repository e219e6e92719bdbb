"""Dataset formats: each turns a `format:` block of the config into a map-style dataset.

What a dataset must have (`Dataset`: `__len__`, `__getitem__`) and what it may have (the
optional parts: `sample`, `source_of`, `shard_starts`, `objects_of`, `storage`, `fingerprint`)
is written once, in _contract.py; the server looks the optional parts up once per dataset, into a
`DatasetParts`. Formats read bytes only through a `Storage` (see sources/), never by opening
paths themselves; those with shards number their samples through one `ShardIndex`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..sources import Storage, open_storage, split_source
from ._contract import OPTIONAL, Dataset, DatasetParts

__all__ = ["OPTIONAL", "Dataset", "DatasetParts", "open_dataset"]


# format -> (module, class): imported on use, so a server imports only the codecs it serves.
_READERS = {"image-folder": ("image_folder", "ImageFolder"), "jsonl": ("jsonl", "Jsonl"),
            "tokens": ("tokens", "Tokens"), "memmap": ("memmap", "Memmap"),
            "tar": ("tar", "Tar"), "parquet": ("parquet", "Parquet"),
            "text": ("text", "Text"), "mds": ("mds", "Mds"),
            "litdata": ("litdata", "Litdata")}
# `mixture` is not a reader of storage: open_dataset builds it from the datasets it draws from.


def open_dataset(name: str, config: Any, cache: Any = None,
                 opened: dict[str, DatasetParts] | None = None) -> Dataset:
    """Open dataset `name` of a validated Config (in the calling process). `cache` is the
    process's DiskCache (needed for s3:// sources). A mixture's components are taken from
    `opened` (datasets this process opened already), else opened here."""
    cfg = config.datasets[name]
    if cfg.format == "mixture":
        from .mixture import Mixture

        opened = opened or {}
        components = {c: opened.get(c) or DatasetParts.of(open_dataset(c, config, cache))
                      for c in cfg.components}
        return Mixture(cfg, components, {c: config.datasets[c] for c in cfg.components})
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
        # text keeps its tokenized corpus in the cache folder, shared by the workers; tar
        # its gzipped shards' uncompressed copies.
        extra = {"cache_dir": config.cache.dir} if cfg.format in ("text", "tar") else {}
        dataset = reader(cfg, storage, pattern, **extra)
    if cfg.transform is not None:
        from .python import WithTransform

        dataset = WithTransform(dataset, cfg.transform)
    return dataset
