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
from ..sources.cache import LOCKS, file_lock
from .chat_images import expand, take_images
from .chat_template import ChatTemplate, TemplateError
from .text import _lookup, cache_entry_files, jsonl_lines

log = logging.getLogger("stoker.server")

BATCH = 256  # conversations tokenized per call
FILES = (".tokens.npy", ".trained.npy", ".offsets.npy", ".sources.npy", ".image_refs.npy",
         ".image_blob.npy", ".image_at.npy", ".image_offsets.npy", ".json")


class _Record(NamedTuple):
    file: int
    where: int  # jsonl: line (1-based); parquet: row (0-based)
    messages: Any
    error: str  # why there are no messages
    images: Any = None  # the record's images column, when there is one


def _jsonl_records(f: int, path: Path, field: str, column: str | None) -> Iterator[_Record]:
    parts = field.split(".")
    images = column.split(".") if column else None
    for n, record, error in jsonl_lines(path):
        if error:
            yield _Record(f, n, None, error)
            continue
        try:
            column_value = None
            if images is not None:
                with contextlib.suppress(KeyError):  # none: the parts hold their images
                    column_value = _lookup(record, images)
            yield _Record(f, n, _lookup(record, parts), "", column_value)
        except KeyError as e:
            yield _Record(f, n, None, f"field {field!r}: {e.args[0]}")


def _parquet_records(f: int, path: Path, where: str, field: str, column: str | None
                     ) -> Iterator[_Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{where}: not a readable Parquet file: {e}") from None
    with pf:
        columns = [field] + ([column] if column else [])
        for c in columns:
            if c not in pf.schema_arrow.names:
                raise ValueError(f"{where}: column {c!r}: no such column; the file has columns "
                                 f"{pf.schema_arrow.names}")
        row = 0
        for g in range(pf.num_row_groups):
            table = pf.read_row_group(g, columns=columns)
            values = table.column(0).to_pylist()
            extra = table.column(1).to_pylist() if column else [None] * len(values)
            for value, images in zip(values, extra, strict=True):
                yield _Record(f, row, value, "", images)
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
    image_refs: np.ndarray  # int64 [I, 3]: kind (chat_images PATH or BYTES), blob start, end
    image_blob: np.ndarray  # uint8: the paths' UTF-8 and the images' bytes
    image_at: np.ndarray  # int64 [I]: each image block's start within its conversation
    image_offsets: np.ndarray  # int64 [D + 1]: each conversation's first image
    meta: dict[str, Any]


def _open_cached(base: str) -> _Corpus | None:
    try:
        meta = json.loads(Path(base + ".json").read_text())
        arrays = [np.asarray(np.load(base + s, mmap_mode="r")) for s in FILES[:-1]]
    except (OSError, ValueError, KeyError):
        return None
    tokens, trained, offsets, sources, refs, blob, at, image_offsets = arrays
    if (len(tokens) != len(trained) or len(offsets) != meta["conversations"] + 1
            or int(offsets[-1]) != len(tokens) or len(sources) != meta["conversations"]
            or len(image_offsets) != len(offsets) or int(image_offsets[-1]) != len(refs)
            or len(at) != len(refs)):
        return None
    for s in FILES:  # a hit is a use: the disk cache evicts least recently used first
        with contextlib.suppress(OSError):
            os.utime(base + s)
    return _Corpus(tokens, trained, offsets, sources, refs, blob, at, image_offsets, meta)


class Renderer:
    """Reads the records of a dataset's files and renders them (`render`, `load`).
    Thread-safe for `render`: the tokenizer and the compiled template are read-only."""

    def __init__(self, storage: Storage, field: str, tokenizer: Any, template: ChatTemplate,
                 image_token: int | None = None, image_count: int = 0,
                 column: str | None = None) -> None:
        self.storage, self.field, self.tokenizer, self.template = (storage, field, tokenizer,
                                                                   template)
        # With `images:`: the image token's id, the tokens of a block, the images column.
        self.image_token, self.image_count, self.column = image_token, image_count, column

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
                yield from _jsonl_records(f, path, self.field, self.column)
            else:
                yield from _parquet_records(f, path, self.storage.where(o.key), self.field,
                                            self.column)

    def _build(self, folder: Path, digest: str, infos: list[ObjectInfo]) -> None:
        t0 = time.perf_counter()
        tokens: list[np.ndarray] = []
        trained: list[np.ndarray] = []
        at: list[np.ndarray] = []
        refs: list[list[tuple[int, bytes]]] = []
        sources: list[tuple[int, int]] = []
        errors: list[tuple[int, str]] = []
        # (record, rendered text, trained spans, image references), awaiting the tokenizer
        texts: list[tuple[int, str, list[tuple[int, int]], list[tuple[int, bytes]]]] = []

        def flush() -> None:
            encs = self.tokenizer.encode_batch([t[1] for t in texts], add_special_tokens=False)
            for (d, _, spans, images), enc in zip(texts, encs, strict=True):
                ids = np.asarray(enc.ids, np.int64)
                flags = _trained(np.asarray(enc.offsets, np.int64).reshape(-1, 2), spans)
                starts = np.zeros(0, np.int64)
                if self.image_token is not None:
                    try:
                        ids, flags, starts = expand(ids, flags, self.image_token,
                                                    self.image_count, len(images))
                    except TemplateError as e:
                        errors.append((d, str(e)))
                        ids, flags, images = ids[:0], flags[:0], []
                tokens.append(ids)
                trained.append(flags)
                at.append(starts)
                refs.append(images)
            texts.clear()

        for rec in self._records(infos):
            d = len(sources)
            sources.append((rec.file, rec.where))
            error, messages = rec.error, rec.messages
            images: list[Any] = []
            if not error:
                try:
                    if self.image_token is not None:
                        messages, images = take_images(messages, rec.images)
                    texts.append((d, *self.template.render(messages), images))
                except TemplateError as e:
                    error = str(e)
            if error:
                errors.append((d, error))
                texts.append((d, "", [], []))  # keeps tokens[] aligned with the records
            if len(texts) >= BATCH:
                flush()
        if texts:
            flush()
        self._write(folder, digest, infos, tokens, trained, sources, at, refs, errors, t0)

    def _write(self, folder: Path, digest: str, infos: list[ObjectInfo],
               tokens: list[np.ndarray], trained: list[np.ndarray],
               sources: list[tuple[int, int]], at: list[np.ndarray],
               refs: list[list[tuple[int, bytes]]], errors: list[tuple[int, str]],
               t0: float) -> None:
        top = max(self.tokenizer.get_vocab_size(with_added_tokens=True) - 1, 0)
        dtype = np.dtype("<u2" if top < 1 << 16 else "<u4")
        empty = np.zeros(0, np.int64)
        lengths = [len(t) for t in tokens]
        flat = [r for conv in refs for r in conv]
        ends = np.cumsum([len(raw) for _, raw in flat], dtype=np.int64)
        arrays = {".tokens.npy": np.concatenate([empty, *tokens]).astype(dtype),
                  ".trained.npy": np.concatenate([empty.astype(np.uint8), *trained]),
                  ".offsets.npy": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]
                                                 ).astype(np.int64),
                  ".sources.npy": np.asarray(sources, np.int64).reshape(-1, 2),
                  ".image_refs.npy": np.stack([np.array([k for k, _ in flat], np.int64),
                                               ends - [len(raw) for _, raw in flat], ends],
                                              axis=1).reshape(-1, 3).astype(np.int64),
                  ".image_blob.npy": np.frombuffer(b"".join(raw for _, raw in flat), np.uint8),
                  ".image_at.npy": np.concatenate([empty, *at]).astype(np.int64),
                  ".image_offsets.npy": np.concatenate(
                      [[0], np.cumsum([len(r) for r in refs], dtype=np.int64)]).astype(np.int64)}
        with cache_entry_files(folder, digest, FILES) as tmp:
            for s, a in arrays.items():
                np.save(tmp[s], a)
            tmp[".json"].write_text(json.dumps({
                "conversations": len(sources), "tokens": int(sum(lengths)),
                "images": len(flat), "errors": sorted(errors),
                "seconds": time.perf_counter() - t0, "files": [o.key for o in infos]}))
