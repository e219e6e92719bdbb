"""The rendered corpus of `format: chat`: every record read, rendered by its chat template,
tokenized and masked once, kept in the cache folder and memory-mapped by every worker.

`DIR/chat/HASH.tokens.npy` (uint16, or uint32 for larger vocabularies), `.trained.npy`
(uint8 per token: 1 where it is trained on), `.offsets.npy` (int64, D + 1: where each
conversation starts), `.sources.npy` (int64 [D, 2]: file index, line or row) and `HASH.json`
(counts, and each bad record's index and why). A bad record is a conversation of no tokens
with an error. HASH (made by the caller) covers what the ids and flags depend on. Files are
written under temp names and renamed, the JSON last, under an fcntl lock on
`DIR/.locks/chat-HASH`: the workers that open the dataset at once build it once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..sources import ObjectInfo, Storage
from ..sources.cache import LOCKS, TMP, file_lock
from .chat_template import ChatTemplate, TemplateError
from .text import _lookup

log = logging.getLogger("stoker.server")

BATCH = 256  # conversations tokenized per call
FILES = (".tokens.npy", ".trained.npy", ".offsets.npy", ".sources.npy", ".json")


class _Record(NamedTuple):
    file: int
    where: int  # jsonl: line (1-based); parquet: row (0-based)
    messages: Any
    error: str  # why there are no messages


def _jsonl_records(f: int, path: Path, field: str) -> Iterator[_Record]:
    parts = field.split(".")
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            body = line.rstrip(b"\n")
            if body in (b"", b"\r"):
                continue
            try:
                yield _Record(f, n, _lookup(json.loads(body), parts), "")
            except json.JSONDecodeError as e:
                yield _Record(f, n, None, f"not valid JSON: {e.msg} at column {e.colno}")
            except UnicodeDecodeError as e:
                yield _Record(f, n, None, f"not valid UTF-8 at byte {e.start + 1}")
            except KeyError as e:
                yield _Record(f, n, None, f"field {field!r}: {e.args[0]}")


def _parquet_records(f: int, path: Path, where: str, field: str) -> Iterator[_Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{where}: not a readable Parquet file: {e}") from None
    with pf:
        if field not in pf.schema_arrow.names:
            raise ValueError(f"{where}: field {field!r}: no such column; the file has columns "
                             f"{pf.schema_arrow.names}")
        row = 0
        for g in range(pf.num_row_groups):
            for value in pf.read_row_group(g, columns=[field]).column(0).to_pylist():
                yield _Record(f, row, value, "")
                row += 1


def _trained(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 per token: 1 where its characters overlap a span (spans sorted, as rendered):
    transformers' assistant_masks, a token at a time there, here at once."""
    if not spans or not len(offsets):
        return np.zeros(len(offsets), np.uint8)
    s = np.asarray(spans, np.int64).reshape(-1, 2)
    j = np.searchsorted(s[:, 1], offsets[:, 0], side="right")  # first span ending after it
    inside = j < len(s)
    out = np.zeros(len(offsets), np.uint8)
    out[inside] = offsets[inside, 1] > s[j[inside], 0]
    return out


class _Corpus(NamedTuple):
    tokens: np.ndarray
    trained: np.ndarray
    offsets: np.ndarray
    sources: np.ndarray
    meta: dict[str, Any]


def _open_cached(base: str) -> _Corpus | None:
    try:
        meta = json.loads(Path(base + ".json").read_text())
        arrays = [np.load(base + s, mmap_mode="r") for s in FILES[:4]]
    except (OSError, ValueError, KeyError):
        return None
    tokens, trained, offsets, sources = (np.asarray(a) for a in arrays)
    if (len(tokens) != len(trained) or len(offsets) != meta["conversations"] + 1
            or int(offsets[-1]) != len(tokens) or len(sources) != meta["conversations"]):
        return None
    for s in FILES:  # a hit is a use: the disk cache evicts least recently used first
        with contextlib.suppress(OSError):
            os.utime(base + s)
    return _Corpus(tokens, trained, offsets, sources, meta)


class Renderer:
    """Reads the records of a dataset's files and renders them (`render`, `load`).
    Thread-safe for `render`: the tokenizer and the compiled template are read-only."""

    def __init__(self, storage: Storage, field: str, tokenizer: Any, template: ChatTemplate
                 ) -> None:
        self.storage, self.field, self.tokenizer, self.template = (storage, field, tokenizer,
                                                                   template)

    def load(self, cache_dir: Path | None, digest: str, infos: list[ObjectInfo]) -> _Corpus:
        folder = None
        if cache_dir is not None:
            try:
                (cache_dir / "chat").mkdir(parents=True, exist_ok=True)
                (cache_dir / LOCKS).mkdir(exist_ok=True)
                folder = cache_dir / "chat"
            except OSError as e:
                log.warning("%s: cannot keep the rendered corpus in %s (%s)", self.storage.url,
                            cache_dir, e)
        if folder is not None:
            with file_lock(folder.parent / LOCKS / f"chat-{digest}"):
                found = _open_cached(str(folder / digest))
                if found is None:
                    self._build(folder, digest, infos)
                    found = _open_cached(str(folder / digest))
            if found is not None:
                return found
        scratch = Path(tempfile.mkdtemp(prefix="stoker-chat-"))
        try:  # the maps stay valid after the files are removed
            self._build(scratch, digest, infos)
            corpus = _open_cached(str(scratch / digest))
            assert corpus is not None
            return corpus
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _records(self, infos: list[ObjectInfo]) -> Iterator[_Record]:
        for f, o in enumerate(infos):
            path = self.storage.local_path(o.key)
            if o.key.endswith(".jsonl"):
                yield from _jsonl_records(f, path, self.field)
            else:
                yield from _parquet_records(f, path, self.storage.where(o.key), self.field)

    def render(self, messages: Any) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, trained flags) of one conversation; TemplateError when it cannot be."""
        text, spans = self.template.render(messages)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return (np.asarray(enc.ids, np.int64),
                _trained(np.asarray(enc.offsets, np.int64).reshape(-1, 2), spans))

    def _build(self, folder: Path, digest: str, infos: list[ObjectInfo]) -> None:
        t0 = time.perf_counter()
        tokens: list[np.ndarray] = []
        trained: list[np.ndarray] = []
        lengths: list[int] = []
        sources: list[tuple[int, int]] = []
        errors: list[tuple[int, str]] = []
        texts: list[tuple[str, list[tuple[int, int]]]] = []

        def flush() -> None:
            encs = self.tokenizer.encode_batch([t for t, _ in texts], add_special_tokens=False)
            for (_, spans), enc in zip(texts, encs, strict=True):
                ids = np.asarray(enc.ids, np.int64)
                tokens.append(ids)
                trained.append(_trained(np.asarray(enc.offsets, np.int64).reshape(-1, 2),
                                        spans))
                lengths[len(tokens) - 1] = len(ids)
            texts.clear()

        for rec in self._records(infos):
            d = len(sources)
            sources.append((rec.file, rec.where))
            lengths.append(0)
            error = rec.error
            if not error:
                try:
                    texts.append(self.template.render(rec.messages))
                except TemplateError as e:
                    error = str(e)
            if error:
                errors.append((d, error))
                texts.append(("", []))  # keeps tokens[] aligned with the records
            if len(texts) >= BATCH:
                flush()
        if texts:
            flush()
        top = max(self.tokenizer.get_vocab_size(with_added_tokens=True) - 1, 0)
        dtype = np.dtype("<u2" if top < 1 << 16 else "<u4")
        empty = np.zeros(0, np.int64)
        arrays = {".tokens.npy": np.concatenate([empty, *tokens]).astype(dtype),
                  ".trained.npy": np.concatenate([empty.astype(np.uint8), *trained]),
                  ".offsets.npy": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]
                                                 ).astype(np.int64),
                  ".sources.npy": np.asarray(sources, np.int64).reshape(-1, 2)}
        tmp = {s: folder / f"{TMP}{os.getpid()}-{digest}{s}" for s in FILES}
        try:
            for s, a in arrays.items():
                np.save(tmp[s], a)
            tmp[".json"].write_text(json.dumps({
                "conversations": len(sources), "tokens": int(sum(lengths)), "errors": errors,
                "seconds": time.perf_counter() - t0, "files": [o.key for o in infos]}))
            for s in FILES:
                os.replace(tmp[s], folder / f"{digest}{s}")
        finally:
            for path in tmp.values():
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
