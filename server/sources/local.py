"""Local (or network-mounted) directories.

A file's version is its mtime and size. Every read checks the file it read against the listing
(an fstat of the open file, after reading: a write before or during the read has moved the
mtime by then), so a file rewritten under a running server fails its samples with DataChanged
instead of serving other bytes under the listed name.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from ._listing import Listing, ObjectInfo
from .storage import DataChanged, StorageError, glob_regex


def _version(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns}-{st.st_size}"


def _when(mtime_ns: int) -> str:
    when = datetime.datetime.fromtimestamp(mtime_ns / 1e9)
    return when.isoformat(sep=" ", timespec="milliseconds")


class LocalStorage:
    def __init__(self, root: Path, follow_symlinks_outside_root: bool = False) -> None:
        self.root = Path(root).resolve()
        self._follow = follow_symlinks_outside_root
        if not self.root.is_dir():
            raise StorageError(f"{root}: not a directory")
        self.url = str(self.root)
        self.listed = Listing()
        self._mapped: set[str] = set()  # keys handed out by local_path, checked per batch

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
                found.append(self._stat(key))
        found.sort(key=lambda o: o.key)
        self.listed.update(found)
        return found

    def info(self, key: str) -> ObjectInfo:
        info = self._stat(key)
        self.listed.add(info)
        return info

    def _stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = path.stat()
        except OSError as e:
            raise StorageError(f"{self.where(key)}: {e.strerror}") from None
        return ObjectInfo(key, st.st_size, _version(st))

    def read(self, key: str) -> bytes:
        return self._read(key, lambda f: f.read())

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self._read(key, lambda f: os.pread(f.fileno(), length, start))

    def _read(self, key: str, how: Callable[[BinaryIO], bytes]) -> bytes:
        """`how(file)` on the key's file, then the file checked against the listing: a file
        rewritten since it was listed fails (DataChanged) instead of serving its new bytes."""
        path = self._path(key)  # its own StorageError, outside the try
        try:
            with open(path, "rb") as f:
                data = how(f)
                self._check(key, os.fstat(f.fileno()))
                return data
        except DataChanged:
            raise
        except OSError as e:
            raise StorageError(f"{self.where(key)}: {e.strerror}") from None

    def verify(self, keys: Iterable[str]) -> None:
        # Only files handed out by local_path (memory-mapped by their format): a file read
        # through read()/read_range() is checked by that read, after it.
        for key in dict.fromkeys(keys):
            if key in self._mapped:
                self._stat_checked(key, self.root / key)  # the key was checked when mapped

    def _stat_checked(self, key: str, path: Path) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise DataChanged(key, "removed") from None
        except OSError as e:
            raise StorageError(f"{self.where(key)}: {e.strerror}") from None
        self._check(key, st)

    def _check(self, key: str, st: os.stat_result) -> None:
        """DataChanged if `st` is not the file as listed; a key read before any listing
        named it (a manifest) is recorded as it is now."""
        version = _version(st)
        listed = self.listed.add(ObjectInfo(key, st.st_size, version))
        if listed.version == version:
            return
        mtime_ns = int(listed.version.partition("-")[0])
        what = []
        if st.st_size != listed.size:
            what.append(f"size {listed.size} -> {st.st_size} bytes")
        if st.st_mtime_ns != mtime_ns:
            what.append(f"modified {_when(mtime_ns)} -> {_when(st.st_mtime_ns)}")
        raise DataChanged(key, "changed", ", ".join(what))

    def local_path(self, key: str) -> Path:
        """The file itself, for a format that maps it: checked against the listing now, and
        before every batch that reads it (verify), since a mapped file is read as it is."""
        path = self._path(key)
        self._stat_checked(key, path)
        self._mapped.add(key)
        return path

    def prefetch(self, keys: Iterable[str]) -> None:
        pass  # the page cache and the disk's read-ahead do this better than we could

    def where(self, key: str) -> str:
        return str(self.root / key)
