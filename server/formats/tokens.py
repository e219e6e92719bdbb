"""`format: tokens`: nanoGPT-style flat token files, memory-mapped, never read whole.

A file is `header_bytes` bytes (skipped) then little-endian uint16 or uint32 tokens. Sample i
is a window of seq_len + 1 tokens: `input_ids` is its first seq_len, `labels` its last seq_len
(the next token of each), both `output_dtype`. Windows start at multiples of seq_len within a
file and never cross into the next file, so a file of n tokens gives max(0, (n - 1) // seq_len)
windows; the tokens after its last full window are not used. Files are taken in key order.

At open the listing's sizes and the first SAMPLE_BYTES of tokens of the first SAMPLE_FILES
files (one ranged read each: for s3:// sources nothing else is downloaded until a file's first
window is read) are checked, because a folder of other binary files would otherwise be served
as windows of garbage. Refused, with an error that says what the files look like:
- a LitData chunk folder (`index.json` beside `chunk-*.bin`) or a Mosaic MDS one (`index.json`
  beside `*.mds`): serialized samples behind headers, not a flat token stream;
- a folder source holding two of nanoGPT's splits (`train.bin`, `val.bin`...): served as one
  they would mix validation into training; the source must name one file or a glob;
- a size that is not `header_bytes` plus whole tokens;
- a sampled token at or above `vocab_size` (when configured); without it, uint16 tokens whose
  every second value is 0 (uint32 tokens read as uint16), or uint32 tokens at or above 2**24
  (uint16 tokens read as uint32: no vocabulary is that large).
With `vocab_size`, every window read is checked too: a token at or above it fails its sample.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from ..sources import ObjectInfo, Storage
from ._shards import ShardIndex
from .memmap import OpenMaps

DEFAULT_PATTERN = "**/*.bin"  # a source that names a directory: every .bin file under it
SAMPLE_FILES = 8  # files whose first tokens are checked at open (a ranged read each)
SAMPLE_BYTES = 4096  # read from the start of each of them (after header_bytes)
UINT32_IMPLAUSIBLE = 1 << 24  # no tokenizer's vocabulary is this large: not uint32 ids
# What nanoGPT's prepare.py scripts write: one file per split.
SPLITS = ("train.bin", "val.bin", "validation.bin", "test.bin")
# The layouts of other tools that a `**/*.bin` or `*.mds` glob picks up, by the name of the
# files beside their index.json, and what serves them.
INDEXED = ((re.compile(r"chunk-\d+-\d+\.bin$"), "a LitData chunk folder",
            "its samples with format: litdata"),
           (re.compile(r"\.mds$"), "a Mosaic MDS folder", "its samples with format: mds"))


class Tokens:
    """Thread-safe: __getitem__ reads immutable arrays and maps opened under a lock."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        self.storage = storage
        self.seq_len = cfg.seq_len
        self.header_bytes = cfg.header_bytes
        self.dtype = np.dtype(cfg.dtype).newbyteorder("<")
        self.output_dtype = np.dtype(cfg.output_dtype)
        self.vocab_size = cfg.vocab_size
        infos = storage.list(pattern or DEFAULT_PATTERN)
        if not infos:
            raise ValueError(f"{storage.url}: no files match {pattern or DEFAULT_PATTERN!r}")
        _refuse_indexed(storage, infos)
        if pattern is None:
            _refuse_splits(storage, infos)
        tokens = []
        for o in infos:
            payload = o.size - self.header_bytes
            if payload < 0 or payload % self.dtype.itemsize:
                raise ValueError(
                    f"{storage.where(o.key)}: {o.size} bytes is not header_bytes "
                    f"({self.header_bytes}) plus whole {cfg.dtype} tokens")
            tokens.append(payload // self.dtype.itemsize)
        # Fixed-width numpy arrays, not lists of str: nothing for copy-on-write to touch.
        self.keys = np.array([o.key for o in infos])
        self.tokens = np.array(tokens, dtype=np.int64)
        windows = np.maximum(0, (self.tokens - 1) // self.seq_len)
        self.files = ShardIndex(windows)
        self.length = self.files.length
        if self.length == 0:
            raise ValueError(f"{storage.url}: no file holds seq_len + 1 = {self.seq_len + 1} "
                             "tokens")
        self.shard_starts = self.files.shard_starts
        for o, n in list(zip(infos, tokens, strict=True))[:SAMPLE_FILES]:
            self._check_sample(o, min(n, SAMPLE_BYTES // self.dtype.itemsize))
        self._maps: OpenMaps[np.memmap] = OpenMaps(storage, self._open)
        self._index = {str(k): i for i, k in enumerate(self.keys)}

    def _check_sample(self, o: ObjectInfo, n: int) -> None:
        """Refuse a file whose first n tokens are not plausibly token ids of this dtype."""
        if n == 0:
            return
        where = self.storage.where(o.key)
        data = self.storage.read_range(o.key, self.header_bytes, n * self.dtype.itemsize)
        sample = np.frombuffer(data, self.dtype, len(data) // self.dtype.itemsize)
        top = int(sample.max())
        if self.vocab_size is not None and top >= self.vocab_size:
            at = int(np.argmax(sample >= self.vocab_size))
            raise ValueError(f"{where}: token {at} is {int(sample[at])}, not below vocab_size "
                             f"{self.vocab_size}: not {self.dtype.name} token ids of that "
                             "vocabulary (check dtype, header_bytes and the file)")
        if self.vocab_size is not None:
            return
        if self.dtype.itemsize == 2 and len(sample) >= 64 and not sample[1::2].any() and (
                sample[0::2].any()):
            raise ValueError(f"{where}: every second uint16 token of the first {len(sample)} "
                             "is 0: these look like uint32 tokens; set dtype: uint32 (or "
                             "vocab_size, if they really are uint16)")
        if self.dtype.itemsize == 4 and top >= UINT32_IMPLAUSIBLE:
            raise ValueError(f"{where}: token ids up to {top} in the first {len(sample)}: no "
                             "vocabulary is that large (uint16 tokens read as uint32?); set "
                             "dtype: uint16, or vocab_size if yours is")

    def _open(self, key: str, path: Path) -> np.memmap:
        n = int(self.tokens[self._index[key]])
        return np.memmap(path, self.dtype, "r", self.header_bytes, (n,))

    def _locate(self, index: int) -> tuple[int, int]:
        f, window = self.files.locate(index)
        return f, window * self.seq_len

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        f, first = self._locate(index)
        tokens = self._maps.get(str(self.keys[f]))
        # A copy, and a plain ndarray (astype would keep the memmap subclass).
        window = np.array(tokens[first : first + self.seq_len + 1], dtype=self.output_dtype)
        if self.vocab_size is not None and int(window.max()) >= self.vocab_size:
            at = int(np.argmax(window >= self.vocab_size))
            raise ValueError(f"token {first + at} is {int(window[at])}, not below vocab_size "
                             f"{self.vocab_size}")
        return {"input_ids": window[:-1], "labels": window[1:]}

    def source_of(self, index: int) -> str:
        f, first = self._locate(index)
        return f"{self.storage.where(str(self.keys[f]))} tokens {first}..{first + self.seq_len}"

    def place_of(self, index: int) -> dict[str, Any]:
        """The seq_len + 1 tokens read (input_ids, and shifted by one, labels)."""
        f, first = self._locate(index)
        size = self.dtype.itemsize
        return {"file": self.storage.where(str(self.keys[f])),
                "offset": self.header_bytes + first * size, "nbytes": (self.seq_len + 1) * size}

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return self.keys[self.files.shards_of(indices)].tolist()


def _folder(key: str) -> str:
    return str(PurePosixPath(key).parent) if "/" in key else ""


def _refuse_indexed(storage: Storage, infos: list[ObjectInfo]) -> None:
    """Refuse files that another tool's index.json describes (LitData, Mosaic MDS)."""
    kinds = {_folder(o.key): kind for o in infos
             for kind in INDEXED if kind[0].search(o.key.rpartition("/")[2])}
    if not kinds:
        return  # no file named like theirs: no second listing
    indexes = {_folder(o.key) for o in storage.list("**/index.json")}
    for folder, (_, what, serve) in sorted(kinds.items()):
        if folder in indexes:
            index = f"{folder}/index.json" if folder else "index.json"
            raise ValueError(f"{storage.where(index)}: {what}, not flat token files: its "
                             f"files hold serialized samples behind headers, which format: "
                             f"tokens would serve as windows of garbage; read {serve}")


def _refuse_splits(storage: Storage, infos: list[ObjectInfo]) -> None:
    """Refuse a folder that holds two of nanoGPT's split files: they would be served as one."""
    splits = sorted({o.key for o in infos if o.key.rpartition("/")[2] in SPLITS})
    names = {k.rpartition("/")[2] for k in splits}
    if len(names) >= 2:
        first = splits[0]
        raise ValueError(f"{storage.url}: holds {', '.join(splits)}: nanoGPT's splits, which a "
                         "folder source would serve as one dataset (validation mixed into "
                         f"training); name one file (source: {storage.where(first)}) or a glob")
