"""`format: tokens`: nanoGPT-style flat token files, memory-mapped, never read whole.

A file is `header_bytes` bytes (skipped) then little-endian uint16 or uint32 tokens. Sample i
is a window of seq_len + 1 tokens: `input_ids` is its first seq_len, `labels` its last seq_len
(the next token of each), both `output_dtype`. Windows start at multiples of seq_len within a
file and never cross into the next file, so a file of n tokens gives max(0, (n - 1) // seq_len)
windows; the tokens after its last full window are not used. Files are taken in key order.

Only the listing's sizes are needed at open: for s3:// sources nothing is downloaded until a
file's first window is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..sources import Storage
from ._shards import ShardIndex
from .memmap import OpenMaps

DEFAULT_PATTERN = "**/*.bin"  # a source that names a directory: every .bin file under it


class Tokens:
    """Thread-safe: __getitem__ reads immutable arrays and maps opened under a lock."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        self.storage = storage
        self.seq_len = cfg.seq_len
        self.header_bytes = cfg.header_bytes
        self.dtype = np.dtype(cfg.dtype).newbyteorder("<")
        self.output_dtype = np.dtype(cfg.output_dtype)
        infos = storage.list(pattern or DEFAULT_PATTERN)
        if not infos:
            raise ValueError(f"{storage.url}: no files match {pattern or DEFAULT_PATTERN!r}")
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
        self._maps: OpenMaps[np.memmap] = OpenMaps(storage, self._open)
        self._index = {str(k): i for i, k in enumerate(self.keys)}

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
        return {"input_ids": window[:-1], "labels": window[1:]}

    def source_of(self, index: int) -> str:
        f, first = self._locate(index)
        return f"{self.storage.where(str(self.keys[f]))} tokens {first}..{first + self.seq_len}"

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return self.keys[self.files.shards_of(indices)].tolist()
