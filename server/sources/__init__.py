"""Where bytes come from: local paths and `s3://bucket/prefix`, behind one small interface.

A format never opens files itself: it asks a `Storage` for keys (paths relative to the
dataset's root, '/'-separated), their sizes, their bytes (whole or a range), or a local file
holding them (the file itself on local disk, the disk-cache entry for S3). Keys are looked up
under the root, never joined blindly: a key cannot name anything outside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._listing import ObjectInfo
from .storage import (
    GLOB_CHARS,
    DataChanged,
    Storage,
    StorageError,
    StorageUnavailable,
    glob_regex,
    split_source,
)

__all__ = ["GLOB_CHARS", "DataChanged", "ObjectInfo", "Storage", "StorageError",
           "StorageUnavailable", "glob_regex", "open_storage", "split_source"]


def open_storage(root: str, s3: Any = None, cache: Any = None, prefetch_bytes: int = 0,
                 follow_symlinks_outside_root: bool = False) -> Storage:
    """The storage for `root` (no glob characters): `s3://...` needs the `s3` settings and a
    `cache` (a DiskCache, see cache.py); anything else is a local directory, whose symlinks
    may lead outside it only with `follow_symlinks_outside_root`."""
    if root.startswith("s3://"):
        from .s3 import S3Storage

        return S3Storage(root, s3, cache, prefetch_bytes)
    if "://" in root:
        raise StorageError(f"{root}: unsupported URL scheme (local paths and s3:// are)")
    from .local import LocalStorage

    return LocalStorage(Path(root), follow_symlinks_outside_root)
