"""`format: text`: documents tokenized once at open, packed into rows of `seq_len` tokens.

Documents: every `.jsonl` file of the source (a record per non-empty line, as in `jsonl`;
`field` is a dotted path in it) and every `.parquet` file (`field` is a string column), in key
order, records in file order. Each is tokenized (tokenizer.py), with BOS in front under
`bos: true` and EOS behind under `eos: true`; its length counts them. A document whose text
gives no token is left out (an EOS alone teaches nothing). A record that is not JSON, lacks the
field, or whose value is not a string (a null in parquet) stops the open, naming the file and
line (parquet: row); under `on_error: skip` it is left out, counted and logged once.
`long_documents: drop` leaves out documents longer than `seq_len`; `split` lets them run on.

The tokenized corpus lives in the cache folder, `DIR/text/HASH.*`: `tokens.npy` (uint16, or
uint32 for larger vocabularies), `offsets.npy` (int64, D + 1: where each document starts),
`sources.npy` (int64 [D, 2]: file index, line or row) and `HASH.json` (counts). HASH covers
what the ids depend on: the source's URL, every file's key, size and version (mtime or ETag),
the field, the tokenizer (file contents, pattern, library version), the BOS/EOS ids and
`on_error`. Files are written under temp names and renamed, the JSON last; an fcntl lock on
`DIR/.locks/text-HASH` makes the workers that open the dataset at once tokenize it once: the
first builds, the others wait and map the result. Every process memory-maps the arrays, so
the workers share one copy in the page cache. With an S3 source the disk cache counts these
files in `cache.max_bytes` and may evict them; the next open then tokenizes again.

The plan of an epoch is a pure function of the key (seed, epoch, shuffle) and the lengths:

    order(e) = default_rng([seed, e, 1]).permutation(D)   if shuffle     (D documents)
             = arange(D)                                   otherwise
    ends(e)  = cumsum(length[order(e)])                    int64, cached for a few epochs

The stream is the documents in that order, back to back; row k is its positions
[k * seq_len, (k + 1) * seq_len). Rows = ceil(T / seq_len) for T tokens in all, the same every
epoch; only the last row is padded. A row finds its first document by binary search in ends,
so building row k costs O(log D + its documents) whatever k, and any server builds it alone.

Each row, every field [seq_len]:
- `input_ids` (int64): the row's tokens, then `pad_id` after the last real token;
- `labels` (int64): the next token of the same document, -100 where there is none: at a
  document's last token (its EOS under `eos: true`, whose label would be the next document)
  and on padding. A document that runs on into the next row gives its last token in this
  row the label of its next token (the first of the next row). With EOS, the label of a
  document's last text token is EOS;
- `position_ids` (int64): the position within the segment, a segment being the part of one
  document inside this row: 0 at every document start and at every row start (a document
  continued from the previous row counts from 0 again). The padding is one segment too,
  0, 1, 2, ..., so position_ids == 0 marks every segment start (cu_seqlens, see
  stoker.client.packing), and the padding is one segment rather than one per token;
- `document_ids` (int32): 0, 1, 2, ... for the row's segments in order, -1 on padding.

`packing_efficiency` (T / (rows * seq_len), the same every epoch) and `cut_fraction` (the
share of documents that cross a row boundary, in file order) are logged at open.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..order.sampling import EpochKey
from ..sources import ObjectInfo, Storage
from ..sources.cache import LOCKS, TMP, file_lock
from .tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("stoker.server")

IGNORE = -100  # the label torch's cross_entropy ignores
SUFFIXES = (".jsonl", ".parquet")
VERSION = 1  # of the cached corpus: bump when its layout or the tokenizing code changes
BATCH_CHARS = 4 << 20  # text encoded per call: large enough for the tokenizer's threads
FILES = (".tokens.npy", ".offsets.npy", ".sources.npy", ".json")  # the JSON last: complete
HEADER = 128  # bytes of the tokens file's .npy header: written first, rewritten at the end


# -- reading documents -----------------------------------------------------------------------
class _Doc(NamedTuple):
    file: int
    where: int  # jsonl: line (1-based); parquet: row (0-based)
    text: str | None
    error: str  # why there is no text


def _lookup(record: Any, parts: list[str]) -> Any:
    value = record
    for i, part in enumerate(parts):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise KeyError(f"no {'.'.join(parts[: i + 1])!r} in the record")
    return value


def jsonl_lines(path: Path) -> Iterator[tuple[int, Any, str]]:
    """Each line of a JSON lines file but blank ones: (line number, its value, "") or, where
    it is not JSON, (line number, None, why)."""
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            body = line.rstrip(b"\n")
            if body in (b"", b"\r"):
                continue
            try:
                value, error = json.loads(body), ""
            except json.JSONDecodeError as e:
                value, error = None, f"not valid JSON: {e.msg} at column {e.colno}"
            except UnicodeDecodeError as e:
                value, error = None, f"not valid UTF-8 at byte {e.start + 1}"
            yield n, value, error


def text_files(storage: Storage, pattern: str | None) -> list[ObjectInfo]:
    """The .jsonl and .parquet files `pattern` names (all of them, in a folder: None)."""
    infos = storage.list(pattern)
    if pattern is None:  # a folder: its .jsonl and .parquet files
        infos = [o for o in infos if o.key.endswith(SUFFIXES)]
    if not infos:
        raise ValueError(f"{storage.url}: no .jsonl or .parquet files match "
                         f"{pattern or '**'!r}")
    for o in infos:
        if not o.key.endswith(SUFFIXES):
            raise ValueError(f"{storage.where(o.key)}: not a .jsonl or .parquet file")
    return infos


def empty_row(seq_len: int, pad_id: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A packed row to fill: input_ids (padding), labels (IGNORE), position_ids (0) and
    document_ids (-1: no document)."""
    return (np.full(seq_len, pad_id, np.int64), np.full(seq_len, IGNORE, np.int64),
            np.zeros(seq_len, np.int64), np.full(seq_len, -1, np.int32))


@contextlib.contextmanager
def cache_entry_files(folder: Path, digest: str, suffixes: tuple[str, ...]
                      ) -> Iterator[dict[str, Path]]:
    """Temporary files for a cache entry's files (suffix -> path), to write in the block: once
    it ends without error each is renamed to `folder/<digest><suffix>`, in `suffixes` order
    (the last one renamed is what a reader checks for); whatever is left is removed."""
    tmp = {s: folder / f"{TMP}{os.getpid()}-{digest}{s}" for s in suffixes}
    try:
        yield tmp
        for s in suffixes:
            os.replace(tmp[s], folder / f"{digest}{s}")
    finally:
        for path in tmp.values():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _jsonl_docs(f: int, path: Path, field: str) -> Iterator[_Doc]:
    parts = field.split(".")
    for n, record, error in jsonl_lines(path):
        if error:
            yield _Doc(f, n, None, error)
            continue
        try:
            value = _lookup(record, parts)
        except KeyError as e:
            yield _Doc(f, n, None, f"field {field!r}: {e.args[0]}")
            continue
        if isinstance(value, str):
            yield _Doc(f, n, value, "")
        else:
            yield _Doc(f, n, None, f"field {field!r}: expected a string, got "
                                   f"{type(value).__name__}")


def _parquet_docs(f: int, path: Path, where: str, field: str) -> Iterator[_Doc]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{where}: not a readable Parquet file: {e}") from None
    with pf:
        schema = pf.schema_arrow
        if field not in schema.names:
            raise ValueError(f"{where}: field {field!r}: no such column; the file has columns "
                             f"{schema.names}")
        t = schema.field(field).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise ValueError(f"{where}: field {field!r}: column is {t}, expected strings")
        row = 0
        for g in range(pf.num_row_groups):
            for value in pf.read_row_group(g, columns=[field]).column(0).to_pylist():
                yield (_Doc(f, row, value, "") if value is not None
                       else _Doc(f, row, None, f"field {field!r}: a null"))
                row += 1


# -- tokenizing into the cache ---------------------------------------------------------------
def _npy_header(dtype: np.dtype, n: int) -> bytes:
    """A .npy (version 1.0) header of exactly HEADER bytes for a 1-D array of n items."""
    text = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': ({n},), }}"
    body = text.ljust(HEADER - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


class _Build:
    """Tokenizes documents in batches, appending ids straight to the tokens file: what stays
    in memory is a few numpy arrays per batch, never a Python object per document."""

    def __init__(self, tok: Tokenizer, bos: int | None, eos: int | None, dtype: np.dtype,
                 out: Any) -> None:
        self.tok, self.bos, self.eos, self.dtype, self.out = tok, bos, eos, dtype, out
        self.lengths: list[np.ndarray] = []
        self.sources: list[np.ndarray] = []
        self.tokens = self.empty = 0

    def add(self, docs: list[_Doc]) -> None:
        texts = [d.text or "" for d in docs]
        ids, lengths = self.tok.encode(texts)
        keep = lengths > 0
        self.empty += int(np.count_nonzero(~keep))
        extra = (self.bos is not None) + (self.eos is not None)
        if extra:  # every document's ids shifted by the specials inserted before it
            doc_of = np.repeat(np.arange(len(docs), dtype=np.int64), lengths)
            kept_before: np.ndarray = np.cumsum(keep) - keep
            out = np.empty(len(ids) + extra * int(keep.sum()), np.int64)
            out[np.arange(len(ids)) + extra * kept_before[doc_of]
                + (self.bos is not None)] = ids
            ends = np.cumsum(lengths[keep] + extra)
            if self.bos is not None:
                out[ends - lengths[keep] - extra] = self.bos
            if self.eos is not None:
                out[ends - 1] = self.eos
            ids = out
        self.out.write(ids.astype(self.dtype).tobytes())
        self.tokens += len(ids)
        self.lengths.append(lengths[keep] + extra)
        self.sources.append(np.array([(d.file, d.where) for d in docs], np.int64
                                     ).reshape(-1, 2)[keep])


class _Corpus(NamedTuple):
    tokens: np.ndarray
    offsets: np.ndarray
    sources: np.ndarray
    meta: dict[str, Any]
    hit: bool


def _open_cached(base: str) -> _Corpus | None:
    try:
        meta = json.loads(Path(base + ".json").read_text())
        arrays = [np.load(base + s, mmap_mode="r" if n else None)
                  for s, n in zip(FILES[:3], (meta["tokens"], 1, meta["documents"]),
                                  strict=True)]
    except (OSError, ValueError, KeyError):
        return None
    tokens, offsets, sources = arrays
    if (len(tokens) != meta["tokens"] or len(offsets) != meta["documents"] + 1
            or sources.shape != (meta["documents"], 2) or int(offsets[-1]) != len(tokens)):
        return None
    for s in FILES:  # a hit is a use: the disk cache evicts least recently used first
        with contextlib.suppress(OSError):
            os.utime(base + s)
    return _Corpus(tokens, offsets, sources, meta, True)


# -- the dataset -----------------------------------------------------------------------------
class Text:
    """Thread-safe: rows are built from read-only arrays; plans are cached whole."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.storage = storage
        self.seq_len = int(cfg.seq_len)
        self.field = cfg.field
        self.skip = cfg.on_error == "skip"
        infos = text_files(storage, pattern)
        self.keys = np.array([o.key for o in infos])
        tok = load_tokenizer(cfg.tokenizer, cfg.tiktoken_pattern)
        self.bos_id = self._special(cfg, tok, "bos")
        self.eos_id = self._special(cfg, tok, "eos")
        self.pad_id = next(i for i in (cfg.pad_id, tok.pad_id, self.eos_id, tok.eos_id, 0)
                           if i is not None)
        digest = self._digest(infos, tok, cfg)
        t0 = time.perf_counter()
        corpus = self._corpus(Path(cache_dir) if cache_dir is not None else None, digest,
                              infos, tok)
        self.open_seconds = time.perf_counter() - t0
        self.cache_hit = corpus.hit
        # Plain ndarray views of the maps: np.memmap's own indexing costs more than the copy.
        self.tokens, self.offsets, self.sources = (
            np.asarray(a) for a in (corpus.tokens, corpus.offsets, corpus.sources))
        self.tokenize_seconds = float(corpus.meta["seconds"])
        self.skipped_documents = int(corpus.meta["skipped"])
        self.empty_documents = int(corpus.meta["empty"])
        if corpus.meta["skipped"] and not corpus.hit:
            log.warning("%s: skipped %d bad documents, the first: %s", storage.url,
                        corpus.meta["skipped"], corpus.meta["first_error"])

        lengths = np.diff(self.offsets)
        keep = lengths <= self.seq_len if cfg.long_documents == "drop" else lengths >= 0
        self.dropped_documents = int(np.count_nonzero(~keep))
        self.documents = np.flatnonzero(keep).astype(np.int64)  # those packed, file order
        self.doc_lengths = lengths[self.documents]
        self.total_tokens = int(self.doc_lengths.sum())
        if self.total_tokens == 0:
            raise ValueError(f"{storage.url}: no tokens in {len(infos)} file(s) "
                             f"({len(lengths)} documents, {self.dropped_documents} longer "
                             "than seq_len dropped)")
        self.length = -(-self.total_tokens // self.seq_len)
        self.packing_efficiency = self.total_tokens / (self.length * self.seq_len)
        ends = np.cumsum(self.doc_lengths)
        cut = (ends - self.doc_lengths) // self.seq_len != (ends - 1) // self.seq_len
        self.cut_fraction = float(cut.mean())
        self.plan = functools.lru_cache(maxsize=4)(self._plan)
        log.info("%s: %d documents, %d tokens (tokenized in %.1f s%s), %d rows of %d: packing "
                 "efficiency %.4f, %.1f%% of documents cut across rows; %d dropped as longer "
                 "than seq_len, %d empty, %d bad", storage.url, len(self.documents),
                 self.total_tokens, self.tokenize_seconds, ", cached" if corpus.hit else "",
                 self.length, self.seq_len, self.packing_efficiency, 100 * self.cut_fraction,
                 self.dropped_documents, self.empty_documents, self.skipped_documents)

    @staticmethod
    def _special(cfg: Any, tok: Tokenizer, name: str) -> int | None:
        if not getattr(cfg, name):
            return None
        value = getattr(cfg, f"{name}_id")
        value = value if value is not None else getattr(tok, f"{name}_id")
        if value is None:
            raise ValueError(f"{name}: tokenizer {cfg.tokenizer} has no {name.upper()} token "
                             f"that stoker knows of; set {name}_id")
        return int(value)

    def _digest(self, infos: list[ObjectInfo], tok: Tokenizer, cfg: Any) -> str:
        key = {"version": VERSION, "url": self.storage.url,
               "files": [[o.key, o.size, o.version] for o in infos], "field": cfg.field,
               "tokenizer": tok.fingerprint, "bos": self.bos_id, "eos": self.eos_id,
               "on_error": cfg.on_error}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]

    # -- the corpus ------------------------------------------------------------------------
    def _corpus(self, cache_dir: Path | None, digest: str, infos: list[ObjectInfo],
                tok: Tokenizer) -> _Corpus:
        folder = None
        if cache_dir is not None:
            try:
                (cache_dir / "text").mkdir(parents=True, exist_ok=True)
                (cache_dir / LOCKS).mkdir(exist_ok=True)
                if not os.access(cache_dir / "text", os.W_OK):
                    raise PermissionError("not writable")
                folder = cache_dir / "text"
            except OSError as e:
                log.warning("%s: cannot keep the tokenized corpus in %s (%s); tokenizing in a "
                            "temporary folder", self.storage.url, cache_dir, e)
        if folder is not None:
            found = _open_cached(str(folder / digest))
            if found is not None:
                return found
            with file_lock(folder.parent / LOCKS / f"text-{digest}"):
                found = _open_cached(str(folder / digest))  # built while we waited
                if found is not None:
                    return found
                self._build(folder, digest, infos, tok)
            built = _open_cached(str(folder / digest))
            if built is not None:  # else evicted at once: fall through, build it privately
                return built._replace(hit=False)
        scratch = Path(tempfile.mkdtemp(prefix="stoker-text-"))
        try:  # the maps stay valid after the files are removed
            self._build(scratch, digest, infos, tok)
            corpus = _open_cached(str(scratch / digest))
            assert corpus is not None
            return corpus._replace(hit=False)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _build(self, folder: Path, digest: str, infos: list[ObjectInfo], tok: Tokenizer) -> None:
        top = max(tok.vocab_size - 1, self.bos_id or 0, self.eos_id or 0)
        dtype = np.dtype("<u2" if top < 1 << 16 else "<u4")
        t0 = time.perf_counter()
        skipped, first_error = 0, ""
        with cache_entry_files(folder, digest, FILES) as tmp:
            with open(tmp[".tokens.npy"], "wb") as out:
                out.write(_npy_header(dtype, 0))
                build = _Build(tok, self.bos_id, self.eos_id, dtype, out)
                batch: list[_Doc] = []
                chars = 0
                for doc in self._documents(infos):
                    if doc.text is None:
                        where = self._where(doc.file, doc.where)
                        if not self.skip:
                            raise ValueError(f"{where}: {doc.error}")
                        skipped += 1
                        first_error = first_error or f"{where}: {doc.error}"
                        continue
                    batch.append(doc)
                    chars += len(doc.text)
                    if chars >= BATCH_CHARS:
                        errors = self._encode(build, batch)
                        batch, chars = [], 0
                        skipped += len(errors)
                        first_error = first_error or next(iter(errors), "")
                if batch:
                    errors = self._encode(build, batch)
                    skipped += len(errors)
                    first_error = first_error or next(iter(errors), "")
                out.seek(0)
                out.write(_npy_header(dtype, build.tokens))
            lengths = np.concatenate([np.zeros(0, np.int64), *build.lengths])
            np.save(tmp[".offsets.npy"], np.concatenate([[0], np.cumsum(lengths)]
                                                        ).astype(np.int64))
            np.save(tmp[".sources.npy"], np.concatenate([np.zeros((0, 2), np.int64),
                                                         *build.sources]))
            meta = {"documents": len(lengths), "tokens": build.tokens, "empty": build.empty,
                    "skipped": skipped, "first_error": first_error,
                    "seconds": time.perf_counter() - t0, "dtype": dtype.str,
                    "files": [o.key for o in infos]}
            tmp[".json"].write_text(json.dumps(meta))

    def _encode(self, build: _Build, batch: list[_Doc]) -> list[str]:
        """Add the batch; returns why each document left out (on_error: skip) was."""
        try:
            build.add(batch)
            return []
        except (ValueError, TypeError) as e:  # the tokenizer refused a text: find which
            if len(batch) > 1:
                return [err for doc in batch for err in self._encode(build, [doc])]
            error = (f"{self._where(batch[0].file, batch[0].where)}: cannot tokenize: "
                     f"{type(e).__name__}: {e}")
            if not self.skip:
                raise ValueError(error) from None
            return [error]

    def _documents(self, infos: list[ObjectInfo]) -> Iterator[_Doc]:
        for f, o in enumerate(infos):
            path = self.storage.local_path(o.key)
            if o.key.endswith(".jsonl"):
                yield from _jsonl_docs(f, path, self.field)
            else:
                yield from _parquet_docs(f, path, self.storage.where(o.key), self.field)

    def _where(self, file: int, where: int) -> str:
        key = str(self.keys[file])
        unit = "line" if key.endswith(".jsonl") else "row"
        return f"{self.storage.where(key)} {unit} {where}"

    # -- packing ---------------------------------------------------------------------------
    def _plan(self, seed: int, epoch: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
        """(documents in stream order, cumulative token counts in that order), read-only."""
        n = len(self.documents)
        perm = (np.random.default_rng([seed, epoch, 1]).permutation(n) if shuffle
                else np.arange(n, dtype=np.int64))
        order = self.documents[perm]
        ends = np.cumsum(self.doc_lengths[perm], dtype=np.int64)
        order.flags.writeable = ends.flags.writeable = False
        return order, ends

    def _segments(self, index: int, key: EpochKey) -> Iterator[tuple[int, int, int]]:
        """(document, first token, end token) of each document part in row `index`."""
        if not 0 <= index < self.length:
            raise IndexError(f"row {index} not in [0, {self.length})")
        order, ends = self.plan(key.seed, key.epoch, key.shuffle)
        a = index * self.seq_len
        b = min(a + self.seq_len, self.total_tokens)
        j = int(np.searchsorted(ends, a, side="right"))
        while a < b:
            d = int(order[j])
            end = int(ends[j])
            start = end - int(self.offsets[d + 1] - self.offsets[d])
            stop = min(b, end)
            yield d, a - start, stop - start
            a = stop
            j += 1

    def sample(self, index: int, key: EpochKey) -> dict[str, np.ndarray]:
        n = self.seq_len
        input_ids, labels, position_ids, document_ids = empty_row(n, self.pad_id)
        t = 0
        for seg, (d, p, q) in enumerate(self._segments(index, key)):
            first, last = int(self.offsets[d]), int(self.offsets[d + 1])
            k = q - p
            input_ids[t : t + k] = self.tokens[first + p : first + q]
            following = self.tokens[first + p + 1 : min(first + q + 1, last)]
            labels[t : t + len(following)] = following
            position_ids[t : t + k] = np.arange(k)
            document_ids[t : t + k] = seg
            t += k
        position_ids[t:] = np.arange(n - t)  # the padding: one segment
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                "document_ids": document_ids}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.sample(index, EpochKey())

    def __len__(self) -> int:
        return self.length

    def source_of(self, index: int, key: EpochKey | None = None) -> str:
        """The documents row `index` draws from, under `key` (default: epoch 0 unshuffled)."""
        parts = [f"{self._where(*map(int, self.sources[d]))} tokens {p}..{q}"
                 for d, p, q in self._segments(index, key or EpochKey())]
        more = f" and {len(parts) - 4} more" if len(parts) > 4 else ""
        return f"row {index}: " + ", ".join(parts[:4]) + more

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return []  # rows read the tokenized corpus, mapped at open; no object to fetch
