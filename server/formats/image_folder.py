"""`format: image-folder`: JPEG/PNG files, decoded to RGB and resized.

Samples are either the files of one sub-folder per class (label = the class's position in the
sorted folder names), or the rows of a `manifest` under the source: CSV with a `path,label`
header, or JSON lines `{"path": ..., "label": ...}`; paths are keys under the source.
Yields `image` (uint8 CHW or HWC as configured, or float CHW after `normalize`; see
images.py for `size:` and `transforms:`) and `label` (int64). With neither `size:` nor
`transforms:`, images keep their own size: each batch is zero-padded to its largest, and
`image_size` (int64 [height, width]) says where each one ends.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..images import decode_version, image_pipeline
from ..order.sampling import EpochKey
from ..sources import Storage
from ._folders import class_folders

EXTENSIONS = (".jpg", ".jpeg", ".png")
INT64 = np.iinfo(np.int64)


def _csv_rows(text: str, where: str) -> Iterator[tuple[int, Any, Any]]:
    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue  # blank lines
        if header is None:
            header = [cell.strip() for cell in row]
            if "path" not in header or "label" not in header:
                raise ValueError(f"{where} line {reader.line_num}: expected a header with "
                                 f"`path` and `label` columns, got {row}")
            p, lab = header.index("path"), header.index("label")
            continue
        if len(row) != len(header):
            raise ValueError(f"{where} line {reader.line_num}: {len(row)} columns, the header "
                             f"has {len(header)}")
        yield reader.line_num, row[p].strip(), row[lab].strip()


def _jsonl_rows(text: str, where: str) -> Iterator[tuple[int, Any, Any]]:
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} line {n}: not JSON: {e}") from None
        if not isinstance(record, dict) or "path" not in record or "label" not in record:
            raise ValueError(f"{where} line {n}: expected an object with `path` and `label`")
        yield n, record["path"], record["label"]


def _label(value: Any) -> int:
    if isinstance(value, str):
        value = int(value)  # "3", " 3", "-1"; not "3.0"
    elif isinstance(value, bool) or not isinstance(value, int):
        raise ValueError
    if not INT64.min <= value <= INT64.max:
        raise ValueError
    return value


def read_manifest(storage: Storage, manifest: str, pattern: str | None
                  ) -> tuple[list[str], list[int]]:
    """The (key, label) rows of a manifest, every key checked against one listing of the
    source (one LIST for S3, not a HEAD per row)."""
    where = storage.where(manifest)
    lower = manifest.lower()
    if lower.endswith(".csv"):
        parse = _csv_rows
    elif lower.endswith((".jsonl", ".json")):
        parse = _jsonl_rows
    else:
        raise ValueError(f"{where}: a manifest must end in .csv, .jsonl or .json")
    try:
        text = storage.read(manifest).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8: {e}") from None
    keys, labels, lines = [], [], []
    for n, path, label in parse(text, where):
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where} line {n}: path must be a non-empty string, got {path!r}")
        key = path.removeprefix("./")
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"{where} line {n}: path {path!r} must be relative to the source "
                             "and stay under it")
        try:
            labels.append(_label(label))
        except ValueError:
            raise ValueError(f"{where} line {n}: label must be an integer (int64), got "
                             f"{label!r}") from None
        keys.append(key)
        lines.append(n)
    if not keys:
        raise ValueError(f"{where}: the manifest lists no images")
    listed = {o.key for o in storage.list(pattern)}
    missing = [i for i, key in enumerate(keys) if key not in listed]
    if missing:
        first = missing[0]
        more = f" (and {len(missing) - 1} more rows)" if len(missing) > 1 else ""
        raise ValueError(f"{where} line {lines[first]}: no file {keys[first]!r} under "
                         f"{storage.url}{more}")
    return keys, labels


class ImageFolder:
    """Thread-safe: __getitem__ reads only immutable numpy arrays."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        self.storage = storage
        if cfg.manifest is not None:
            keys, labels = read_manifest(storage, cfg.manifest, pattern)
        else:
            keys, labels = class_folders(storage, pattern, EXTENSIONS)
        # Fixed-width numpy arrays, not lists of str: no per-item refcounts to copy on write.
        self.keys = np.array(keys)
        self.labels = np.array(labels, dtype=np.int64)
        self.pipeline = image_pipeline(cfg)

    def __len__(self) -> int:
        return len(self.keys)

    def sample(self, index: int, key: EpochKey) -> dict[str, np.ndarray | np.int64]:
        out: dict[str, np.ndarray | np.int64] = {}
        prefix = self.pipeline.cached(index)  # then the file is not read
        data = None if prefix is not None else self.storage.read(str(self.keys[index]))
        self.pipeline.write(out, "image", data, key.rng(index), index, prefix)
        out["label"] = self.labels[index]
        return out

    def __getitem__(self, index: int) -> dict[str, np.ndarray | np.int64]:
        return self.sample(index, EpochKey())

    def decode_version(self) -> str:
        """The JPEG decode's version, where the dataset has JPEG files (by their names): a
        folder of PNGs gives the same bytes whatever the JPEG decode."""
        names = np.char.lower(self.keys)
        if not np.any(np.char.endswith(names, ".jpg") | np.char.endswith(names, ".jpeg")):
            return ""
        return decode_version([self.pipeline])

    def use_prefix_cache(self, scope: Any) -> None:
        self.pipeline.use_cache(scope("image", self.pipeline.prefix_spec))

    def source_of(self, index: int) -> str:
        return self.storage.where(str(self.keys[index]))

    def place_of(self, index: int) -> dict[str, Any]:
        """Its file (path, or an object's s3:// URL), read whole."""
        return {"file": self.source_of(index)}

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return [str(k) for k in self.keys[indices]]
