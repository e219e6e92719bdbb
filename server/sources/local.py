"""Local (or network-mounted) directories."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from . import ObjectInfo, StorageError, glob_regex


class LocalStorage:
    def __init__(self, root: Path, follow_symlinks_outside_root: bool = False) -> None:
        self.root = Path(root).resolve()
        self._follow = follow_symlinks_outside_root
        if not self.root.is_dir():
            raise StorageError(f"{root}: not a directory")
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        # Resolved and checked, so that neither `..` nor a symlink leads outside the root
        # (symlinks may, where the operator set follow_symlinks_outside_root; `..` never).
        lexical = Path(os.path.normpath(self.root / key))
        if not lexical.is_relative_to(self.root):
            raise StorageError(f"{self.root / key}: outside the dataset root {self.root}")
        path = (self.root / key).resolve()
        if not self._follow and not path.is_relative_to(self.root):
            raise StorageError(f"{self.root / key}: a symlink to {path}, outside the dataset "
                               f"root {self.root} (set follow_symlinks_outside_root: true "
                               "on the dataset to allow it)")
        return path

    def list(self, pattern: str | None = None) -> list[ObjectInfo]:
        match = glob_regex(pattern).match if pattern else None
        found = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if name.startswith(".") or (match and not match(key)):
                    continue
                found.append(self.info(key))
        found.sort(key=lambda o: o.key)
        return found

    def info(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = path.stat()
        except OSError as e:
            raise StorageError(f"{self.where(key)}: {e.strerror}") from None
        return ObjectInfo(key, st.st_size, f"{st.st_mtime_ns}-{st.st_size}")

    def read(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except OSError as e:
            raise StorageError(f"{self.where(key)}: {e.strerror}") from None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return os.pread(f.fileno(), length, start)
        except OSError as e:
            raise StorageError(f"{self.where(key)}: {e.strerror}") from None

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def prefetch(self, keys: Iterable[str]) -> None:
        pass  # the page cache and the disk's read-ahead do this better than we could

    def where(self, key: str) -> str:
        return str(self.root / key)
