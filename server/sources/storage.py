"""The storage interface: `Storage`, its errors, and the source-string helpers
(`split_source`, `glob_regex`) every storage and format shares. What it lists, `ObjectInfo`,
is its `Listing`'s (_listing.py)."""


from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from ._listing import Listing, ObjectInfo

GLOB_CHARS = frozenset("*?[")


class StorageError(OSError):
    """An object that cannot be listed or read; the message names its full URL."""


class DataChanged(StorageError):
    """An object whose bytes differ from what the server listed (a file rewritten, resized or
    removed; an S3 object overwritten). Never skipped under `on_error: skip`: what would stand
    in for it is not the data the server's fingerprint describes. The message names the key
    (relative to the dataset's root) and what changed."""

    def __init__(self, key: str, what: str = "changed", detail: str = "") -> None:
        detail = f" ({detail})" if detail else ""
        super().__init__(f"{key}: {what} since the server listed it{detail}; restart the "
                         "server to serve the new data")
        self.key = key


class StorageUnavailable(StorageError):
    """Storage that did not answer (an S3 outage past the retries, 5xx, a connection that
    keeps breaking): transient and of this server's making, so the client is answered
    UNAVAILABLE and asks another server, and `on_error: skip` never skips it (the sample is
    not bad)."""


class Storage(Protocol):
    url: str  # the root: a directory path, or s3://bucket/prefix
    # Every object list() and info() returned, by key, as first seen: what the dataset's
    # fingerprint covers (server/order/fingerprint.py) and what reads are checked against.
    listed: Listing

    def list(self, pattern: str | None = None) -> list[ObjectInfo]:
        """Objects under the root whose key matches the glob `pattern` (all if None),
        sorted by key. `*` and `?` stay within one path segment; `**/` spans folders."""
        ...

    def info(self, key: str) -> ObjectInfo: ...
    def read(self, key: str) -> bytes: ...
    def read_range(self, key: str, start: int, length: int) -> bytes: ...

    def local_path(self, key: str) -> Path:
        """A local file with the object's bytes, for memory maps and sequential readers."""
        ...

    def prefetch(self, keys: Iterable[str]) -> None:
        """A hint: these keys will be read soon. Never blocks, never raises."""
        ...

    def verify(self, keys: Iterable[str]) -> None:
        """Raise DataChanged if one of these listed objects changed since it was listed (local
        files: one stat each; S3: nothing, reads send If-Match with the listed ETag)."""
        ...

    def where(self, key: str) -> str:
        """The object's full URL or path, for error messages."""
        ...


def split_source(source: str) -> tuple[str, str | None]:
    """`data/*.jsonl` -> (`data`, `*.jsonl`); `s3://b/p/**/*.tar` -> (`s3://b/p`, `**/*.tar`);
    a local file -> (its folder, its name); any other source without glob characters is all
    root."""
    if "://" not in source and Path(source).is_file():  # one local file
        path = Path(source)
        return str(path.parent), re.sub(r"([*?\[])", r"[\1]", path.name)
    parts = source.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if GLOB_CHARS & set(part):
            root = "/".join(parts[:i]) or "."
            return root, "/".join(parts[i:])
    return source.rstrip("/") or "/", None


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A compiled regex for a '/'-separated glob: `*`, `?`, `[...]` within a segment,
    `**/` zero or more whole segments, a final `**` anything."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            body = body.replace("\\", "\\\\").replace("[", "\\[")
            body = "^" + body[1:] if body.startswith("!") else body
            out.append(f"[{body}]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")
