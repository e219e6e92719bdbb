"""`format: jsonl`: records, one JSON object per line, from one file or many.

Every non-empty line is a record (a line holding only "\\r" counts as empty; one with other
whitespace only is a record, and a bad one); a last line without a newline counts. Files are
taken in key order; a source that names a directory takes every `*.jsonl` file under it.

At open, each file's lines are found once (a vectorised newline search over a memory map, in
chunks) and kept as one int64 array of record start offsets: no Python object per record.
Sample i parses its line and, for each configured field, takes the value at the field's
dotted path (`a.b.0` walks objects by key and lists by position), checked and converted to
the field's dtype and shape. `utf8` fields become the text's UTF-8 bytes as uint8[max_bytes],
zero-padded, cut at a character boundary when longer, plus `<name>_length` (int64): the
bytes kept (`utf8_padded`, which format: parquet uses too). A null becomes the field's
`fill` where it has one (inside lists too); without one it fails its sample. A field whose
shape starts with -1 is a list of any length, returned `Padded` (zero-padded to the batch's
longest when collated). `length_column` names the field that gives each record's token count
(`sample_lengths`, for token budgets: a list's length or an integer's value, read at open by
parsing every record once); a list one also gets `attention_mask` (1 per item, padded alike).

A field without `dtype` gets one at open, from its values in the first INFER_RECORDS records
(at most INFER_BYTES of them; in key order; records that do not parse or lack the field are
passed over): bool when every value seen is a bool, int64 when every one is an integer (a
JSON number without `.` or an exponent; int64 is the type pandas and torch use for labels,
and no narrower type is safe for values not yet seen), else float32. A later record whose
value does not fit the inferred type fails its sample, as with a configured dtype. A field
whose first values are strings or objects stops the open: it needs `dtype: utf8`.

A field with `decode: video_frames` is a video's path (a key under the source) with its time
at `time_column` (a dotted path): the frames shown at that time plus each offset, decoded as
format: parquet's `video_frames` (formats/video.py's FramesAt), PyAV imported only then.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..order.sampling import EpochKey
from ..sources import Storage
from ._shards import ShardIndex
from .memmap import OpenMaps
from .samples import padded

DEFAULT_PATTERN = "**/*.jsonl"  # a source that names a directory
CHUNK = 64 << 20  # bytes scanned at a time: the comparison's temporary stays this small
INFER_RECORDS = 1000  # records read at open to infer a dtype-less field's dtype,
INFER_BYTES = 16 << 20  # or fewer: as many as fit in this many bytes (at least one)
NEWLINE = ord("\n")
# With a list-valued length_column: 1 on each real token, 0 on the padding (the collated
# batch pads the list and this mask alike, to the batch's longest).
MASK = "attention_mask"


def _map(path: Path) -> mmap.mmap | None:
    """A read-only map of the file, None when it is empty (mmap refuses empty files)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None


def line_starts(mm: mmap.mmap) -> np.ndarray:
    """The start offset of every non-empty line of a mapped file (int64)."""
    buf = np.frombuffer(mm, np.uint8)
    try:
        newlines = np.concatenate(
            [np.flatnonzero(buf[a : a + CHUNK] == NEWLINE) + a
             for a in range(0, len(buf), CHUNK)]).astype(np.int64)
        starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
        ends = np.append(newlines, len(buf))
        lengths = ends - starts
        keep = lengths > 0
        cr_only = np.flatnonzero(lengths == 1)
        keep[cr_only[buf[starts[cr_only]] == ord("\r")]] = False
    finally:
        del buf  # the map cannot close while a view of it exists
    return starts[keep]


def utf8_padded(text: str, max_bytes: int) -> tuple[np.ndarray, np.int64]:
    """`text`'s UTF-8 bytes zero-padded to uint8[max_bytes] (cut at a character boundary
    when longer), and how many bytes were kept."""
    data = text.encode("utf-8")
    if len(data) > max_bytes:  # cut at a character boundary
        data = data[:max_bytes].decode("utf-8", "ignore").encode("utf-8")
    out = np.zeros(max_bytes, np.uint8)
    out[: len(data)] = np.frombuffer(data, np.uint8)
    return out, np.int64(len(data))


def _filled(value: Any, fill: Any) -> Any:
    """`value` with every null (at any depth of lists) replaced by `fill`."""
    if value is None:
        return fill
    if isinstance(value, list):
        return [_filled(v, fill) for v in value]
    return value


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def infer_dtype(name: str, values: list[Any]) -> np.dtype:
    """The dtype of a field whose values (from the first records) are these: see above."""
    leaves = [v for value in values for v in _leaves(value) if v is not None]
    if any(isinstance(v, str | dict) for v in leaves):
        kind = next(type(v).__name__ for v in leaves if isinstance(v, str | dict))
        raise ValueError(f"field {name!r}: holds {kind} values, not numbers: set its dtype "
                         "(utf8 for text, with max_bytes)")
    if leaves and all(isinstance(v, bool) for v in leaves):
        return np.dtype(np.bool_)
    if leaves and all(isinstance(v, int) for v in leaves):
        return np.dtype(np.int64)
    return np.dtype(np.float32)


class _Field:
    def __init__(self, name: str, cfg: Any) -> None:
        self.name = name
        self.path = tuple((cfg.path or name).split("."))
        self.utf8 = cfg.dtype == "utf8"
        self.frames: Any = None  # decode: video_frames
        self.time_path: tuple[str, ...] = ()
        if getattr(cfg, "decode", None) == "video_frames":  # PyAV only where a field needs it
            from .video import FramesAt

            self.frames = FramesAt(cfg)
            self.time_path = tuple(cfg.time_column.split("."))
        self.infer = cfg.dtype is None and self.frames is None  # Jsonl sets self.dtype at open
        self.dtype = np.dtype(np.uint8 if self.utf8 else cfg.dtype or np.float32)
        self.fill = getattr(cfg, "fill", None)
        self.shape = tuple(cfg.shape)
        self.variable = self.shape[:1] == (-1,)  # a list of any length, padded when collated
        self.max_bytes = cfg.max_bytes
        if self.utf8 and self.max_bytes is None:
            raise ValueError(f"field {name!r}: dtype utf8 needs max_bytes")
        if self.utf8 and self.shape:
            raise ValueError(f"field {name!r}: a utf8 field is one string; shape must be []")
        if not self.utf8 and self.max_bytes is not None:
            raise ValueError(f"field {name!r}: max_bytes applies to dtype utf8 only")

    def lookup(self, record: Any, path: tuple[str, ...] | None = None) -> Any:
        value = record
        path = path or self.path
        for i, part in enumerate(path):
            at = ".".join(path[: i + 1])
            if isinstance(value, dict):
                if part not in value:
                    raise KeyError(f"field {self.name!r}: no {at!r} in the record")
                value = value[part]
            elif isinstance(value, list) and part.isdigit():
                if int(part) >= len(value):
                    raise KeyError(f"field {self.name!r}: {at!r}: list has {len(value)} items")
                value = value[int(part)]
            else:
                raise KeyError(f"field {self.name!r}: {at!r}: a {type(value).__name__} has no "
                               "keys")
        return value

    def frames_of(self, record: Any, out: dict[str, Any], storage: Storage,
                  rng: np.random.Generator) -> None:
        """decode: video_frames: the frames shown at the record's time plus each offset."""
        key, time = self.lookup(record), self.lookup(record, self.time_path)
        if not isinstance(key, str):
            raise TypeError(f"field {self.name!r}: expected a video's path, got "
                            f"{type(key).__name__}")
        if isinstance(time, bool) or not isinstance(time, int | float):
            raise TypeError(f"field {self.name!r}: time_column {'.'.join(self.time_path)!r}: "
                            f"expected seconds, got {_describe(time)}")
        self.frames.write(out, self.name, storage, key, float(time), rng)

    def convert(self, value: Any, out: dict[str, Any]) -> None:
        if self.fill is not None:
            value = _filled(value, self.fill)
        if self.utf8:
            if not isinstance(value, str):
                raise TypeError(f"field {self.name!r}: expected a string, got "
                                f"{type(value).__name__}")
            out[self.name], out[f"{self.name}_length"] = utf8_padded(value, self.max_bytes)
            return
        if value is None:
            raise TypeError(f"field {self.name!r}: a null (set the field's fill to replace "
                            "nulls)")
        if isinstance(value, str | dict):
            raise TypeError(f"field {self.name!r}: expected {self.dtype} numbers, got "
                            f"{type(value).__name__}")
        try:
            raw = np.asarray(value)
        except ValueError:  # ragged lists
            raise TypeError(f"field {self.name!r}: ragged lists") from None
        if raw.dtype.kind not in "biuf":
            raise TypeError(f"field {self.name!r}: expected {self.dtype} numbers, got "
                            f"{_describe(value)}")
        if raw.shape != self.shape and not (
                self.variable and raw.ndim == len(self.shape) and raw.shape[1:] == self.shape[1:]):
            raise ValueError(f"field {self.name!r}: shape {list(raw.shape)}, expected "
                             f"{list(self.shape)}")
        with np.errstate(all="ignore"):  # checked below instead
            arr = raw.astype(self.dtype)
        if (not np.array_equal(arr, raw) if self.dtype.kind in "biu"
                else np.any(np.isinf(arr) & ~np.isinf(raw))):
            why = (" (the dtype inferred from the first records: set the field's dtype)"
                   if self.infer else "")
            raise ValueError(f"field {self.name!r}: {_describe(value)} does not fit "
                             f"{self.dtype}{why}")
        out[self.name] = padded(arr, (0,)) if self.variable else arr


def _describe(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Jsonl:
    """Thread-safe: __getitem__ reads immutable arrays and maps opened under a lock."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        self.storage = storage
        self.fields = [_Field(name, f) for name, f in cfg.fields.items()]
        names = [f.name for f in self.fields]
        for f in self.fields:
            if f.utf8 and f"{f.name}_length" in names:
                raise ValueError(f"field {f.name}_length: clashes with utf8 field {f.name!r}'s "
                                 "length")
        infos = storage.list(pattern or DEFAULT_PATTERN)
        if not infos:
            raise ValueError(f"{storage.url}: no files match {pattern or DEFAULT_PATTERN!r}")
        offsets, counts = [], []
        for o in infos:
            mm = _map(storage.local_path(o.key))
            if mm is None:
                starts = np.zeros(0, np.int64)
            else:
                with mm:
                    starts = line_starts(mm)
            offsets.append(starts)
            counts.append(len(starts))
        # Fixed-width numpy arrays, not lists: nothing for copy-on-write to touch.
        self.keys = np.array([o.key for o in infos])
        self.offsets = np.concatenate(offsets)
        self.files = ShardIndex(counts)
        self.length = self.files.length
        if self.length == 0:
            raise ValueError(f"{storage.url}: no records in {len(infos)} file(s)")
        self.shard_starts = self.files.shard_starts
        self._maps: OpenMaps[mmap.mmap | None] = OpenMaps(storage, lambda _, p: _map(p))
        infer = [f for f in self.fields if f.infer]
        if infer:
            self._infer(infer)
        self.length_field = self._length_field(cfg.length_column)
        # An optional part (formats/_contract.py): present only with length_column.
        self.sample_lengths = None if self.length_field is None else self._lengths

    def _length_field(self, name: str | None) -> _Field | None:
        """The field that gives each record's token count (`length_column`), checked."""
        if name is None:
            return None
        found = next((f for f in self.fields if f.name == name), None)
        if found is None:
            raise ValueError(f"length_column: {name!r} is not one of the fields "
                             f"{[f.name for f in self.fields]}")
        if not (found.variable and len(found.shape) == 1) and not (
                found.shape == () and found.dtype.kind in "iu"):
            raise ValueError(f"length_column: field {name!r} must be a list of any length "
                             "(shape [-1]) or an integer (the length itself)")
        if found.variable and MASK in [f.name for f in self.fields]:
            raise ValueError(f"field {MASK}: clashes with the mask length_column {name!r} "
                             "adds")
        return found

    def _lengths(self) -> np.ndarray:
        """Each record's token count: the length of its `length_column` list, or that
        field's integer. Parses every record once (the open of a dataset with
        length_column reads it all); a record that does not parse or lacks the field stops
        it, naming the line."""
        field = self.length_field
        assert field is not None
        out = np.empty(self.length, np.int64)
        for index in range(self.length):
            try:
                value = field.lookup(json.loads(self._line(index)))
                out[index] = len(value) if field.variable else int(value)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{self.source_of(index)}: length_column {field.name!r}: "
                                 f"{e.args[0] if e.args else e}") from None
        if len(out) and out.min() < 0:
            raise ValueError(f"{self.source_of(int(np.argmin(out)))}: length_column "
                             f"{field.name!r}: a negative length")
        return out

    def _infer(self, fields: list[_Field]) -> None:
        """Set each field's dtype from its values in the first INFER_RECORDS records."""
        values: dict[str, list[Any]] = {f.name: [] for f in fields}
        read = 0
        for index in range(min(self.length, INFER_RECORDS)):
            line = self._line(index)
            read += len(line)
            if read > INFER_BYTES and index:
                break
            try:
                record = json.loads(line)
            except ValueError:  # JSONDecodeError, UnicodeDecodeError: fails when read
                continue
            for f in fields:
                try:
                    values[f.name].append(f.lookup(record))
                except KeyError:
                    pass
        for f in fields:
            try:
                f.dtype = infer_dtype(f.name, values[f.name])
            except ValueError as e:
                raise ValueError(f"{self.storage.url}: {e}") from None

    def _line(self, index: int) -> bytes:
        key = str(self.keys[self.files.locate(index)[0]])
        mm = self._maps.get(key)
        start = int(self.offsets[index])
        if mm is None or start >= len(mm):
            raise ValueError(f"{self.source_of(index)}: the file changed since the server started")
        end = mm.find(b"\n", start)
        return mm[start : end if end >= 0 else len(mm)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.sample(index, EpochKey())

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        line = self._line(index)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:  # its own "line 1" would only confuse
            raise ValueError(f"{self.source_of(index)}: not valid JSON: {e.msg} at column "
                             f"{e.colno}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.source_of(index)}: not valid UTF-8 at byte "
                             f"{e.start + 1}") from None
        out: dict[str, Any] = {}
        rng = key.rng(index) if any(f.frames for f in self.fields) else None
        for field in self.fields:  # video fields share one generator, in field order
            try:
                if field.frames is not None:
                    assert rng is not None  # made above whenever a field has frames
                    field.frames_of(record, out, self.storage, rng)
                else:
                    field.convert(field.lookup(record), out)
            except (KeyError, TypeError, ValueError) as e:
                msg = e.args[0] if e.args else str(e)
                raise ValueError(f"{self.source_of(index)}: {msg}") from None
        if self.length_field is not None and self.length_field.variable:
            out[MASK] = padded(np.ones(len(out[self.length_field.name]), np.int64), (0,))
        return out

    def source_of(self, index: int) -> str:
        """`FILE line N` (1-based) of sample `index`."""
        place = self.place_of(index, nbytes=False)
        return f"{place['file']} line {place['line']}"

    def place_of(self, index: int, nbytes: bool = True) -> dict[str, Any]:
        """Its file, line (1-based), and the byte offset and length of its record (without
        the newline)."""
        key = str(self.keys[self.files.locate(index)[0]])
        mm = self._maps.get(key)
        start = int(self.offsets[index])
        line = 1
        if mm is not None:  # newlines before the record: blank lines are lines too
            buf = np.frombuffer(mm, np.uint8)
            try:
                line += sum(int(np.count_nonzero(buf[a : min(a + CHUNK, start)] == NEWLINE))
                            for a in range(0, start, CHUNK))
            finally:
                del buf
        place = {"file": self.storage.where(key), "offset": start, "line": line}
        if nbytes and mm is not None and start < len(mm):
            end = mm.find(b"\n", start)
            place["nbytes"] = (end if end >= 0 else len(mm)) - start
        return place

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return self.keys[self.files.shards_of(indices)].tolist()
