"""`format: chat`: conversations rendered through a chat template, tokenized and masked once
at open, packed whole into rows of `seq_len` tokens.

Conversations: the records of every `.jsonl` file (`field` a dotted path to the list of
messages) and every `.parquet` file (`field` a list<struct> column), in key order, records in
file order, as `format: text` reads documents. Each is rendered by chat_template.py (as
`transformers` renders it), the text is tokenized with the tokenizer.json's added tokens
recognized (as `apply_chat_template(tokenize=True)` does), and a token is trained on where
its characters overlap a span the template marked (transformers' `assistant_masks`) or, without
markers, an assistant turn up to its end-of-turn token (`end_of_turn`, else the EOS).

A record that cannot be rendered (not a list of messages, a role the template refuses, any
template error) does not stop the open: under `on_error: raise` it becomes a row of its own,
after the packed rows, whose read fails (DATA_LOSS naming the file, line or row, and the
template's message); under `skip` it is left out, counted and logged.

The rendered corpus lives in the cache folder (chat_corpus.py), HASH covering the files' keys,
sizes and versions, the field, the tokenizer file, the template, its special tokens,
`loss_on` and the mask rule (chat_template.Rule) with its end-of-turn token; it is built once
under an fcntl lock and memory-mapped by every worker, as in formats/text.py.

Rows. The plan is made once, at open, from the lengths alone: a conversation longer than
seq_len is cut to its first seq_len tokens (`long: truncate`), left out (`drop`) or cut into
seq_len pieces (`split`, each piece placed like a conversation). `pack: false`: a piece per
row, in file order. `pack: true`: the pieces of each window of WINDOW consecutive ones (file
order) go into rows best fit decreasing (the longest first, each into the fullest row it fits
in). The number of rows is therefore the same for every (seed, epoch): it is the dataset's
len(), which clients and every server agree on; the client's `shuffle=True` orders the rows by
(seed, epoch) like any dataset's samples, so elastic resume, `batch_at` and `seek` are exact
as they are for any dataset. (A packing that changed per epoch would change len() per epoch,
which the ordering in server/order/ does not allow.)

Each row, every field [seq_len]: `input_ids` (pad_id after the real tokens), `labels` (the
next token of the same conversation where that token is trained on, else -100; -100 at a
conversation's last token and on padding; a `split` piece's last token has its next piece's
first token as label when trained), `position_ids` (0.. within each piece; the padding one
more segment 0, 1, ... as in `format: text`), `document_ids` (int32, 0, 1, ... per piece, -1
on padding), `attention_mask` (1 on real tokens, 0 on padding).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..order.sampling import EpochKey
from ..sources import Storage
from .chat_corpus import Renderer
from .chat_images import Images, output_shape
from .chat_template import ChatTemplate
from .samples import padded
from .text import IGNORE, empty_row, text_files

log = logging.getLogger("stoker.server")

VERSION = 2  # of the cached corpus (2: spans end at the end-of-turn token)
WINDOW = 8192  # pieces packed together: the plan's unit of work


class Chat:
    """Thread-safe: rows are built from read-only arrays and a plan made at open."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        infos = text_files(storage, pattern)
        self.keys = [o.key for o in infos]
        self.storage = storage
        self.seq_len = int(cfg.seq_len)
        self.field = cfg.field
        import tokenizers

        raw = Path(cfg.tokenizer).read_bytes()
        try:
            self.tokenizer = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library's own parse errors
            raise ValueError(f"tokenizer {cfg.tokenizer}: cannot load: {e}") from None
        self.template = ChatTemplate.for_tokenizer(cfg.tokenizer, cfg.chat_template,
                                                   cfg.loss_on, self._end_of_turn(cfg))
        special = self.template.special
        ids = {k: self.tokenizer.token_to_id(v) for k, v in special.items()}
        self.pad_id = next(i for i in (cfg.pad_id, ids.get("pad_token"), ids.get("eos_token"), 0)
                           if i is not None)
        image_token, image_count, pipeline, shape = self._image_settings(cfg.images)
        digest = hashlib.sha256(json.dumps({
            "version": VERSION, "url": storage.url, "field": cfg.field,
            "files": [[o.key, o.size, o.version] for o in infos],
            "tokenizer": [tokenizers.__version__, hashlib.sha256(raw).hexdigest()],
            "template": self.template.text, "special": special, "loss_on": cfg.loss_on,
            "rule": [self.template.rule.value, self.template.end_of_turn],
            "images": [image_token, image_count, cfg.images and cfg.images.column],
        }, sort_keys=True).encode()).hexdigest()[:40]
        renderer = Renderer(storage, cfg.field, self.tokenizer, self.template, image_token,
                            image_count, cfg.images.column if cfg.images else None)
        corpus = renderer.load(Path(cache_dir) if cache_dir is not None else None, digest, infos)
        self.tokens, self.trained, self.offsets, self.sources = corpus[:4]
        self.images = (None if pipeline is None else
                       Images(storage, pipeline, shape, *corpus[4:8]))
        self.image_tokens = image_count
        self.errors = {int(d): e for d, e in corpus.meta["errors"]}
        self._plan(cfg)
        log.info("%s: %d conversations, %d tokens in %d rows of %d: packing efficiency %.4f; "
                 "%d longer than seq_len (%s), %d bad (%s)", storage.url,
                 len(self.offsets) - 1, self.total_tokens, self.length, self.seq_len,
                 self.packing_efficiency, self.long_conversations, cfg.long,
                 len(self.errors), cfg.on_error)
        if self.errors and cfg.on_error == "skip":
            first, why = next(iter(self.errors.items()))
            log.warning("%s: skipped %d bad conversations, the first: %s", storage.url,
                        len(self.errors), self._error(first, why))

    def decode_version(self) -> str:
        """Its images' decode."""
        if self.images is None:
            return ""
        from ..images import decode_version

        return decode_version([self.images.pipeline])

    def _end_of_turn(self, cfg: Any) -> str | None:
        """The `end_of_turn` token's text: one token of the tokenizer, named or numbered."""
        given = cfg.end_of_turn
        if given is None:
            return None
        if isinstance(given, int):
            text = self.tokenizer.id_to_token(given)
            if text is None:
                raise ValueError(f"end_of_turn: {given} is not a token id of the tokenizer "
                                 f"({self.tokenizer.get_vocab_size()} tokens)")
            return str(text)
        if self.tokenizer.token_to_id(given) is None:
            raise ValueError(f"end_of_turn: {given!r} is not a token of the tokenizer (give "
                             "the text of one token, as the template writes it, or its id)")
        return str(given)

    def _image_settings(self, cfg: Any) -> tuple[int | None, int, Any, tuple[int, ...]]:
        """(the image token's id, tokens per image, the pipeline, its output shape)."""
        if cfg is None:
            return None, 0, None, ()
        from ..images import image_pipeline

        token = self.tokenizer.token_to_id(cfg.token)
        if token is None:
            raise ValueError(f"images.token {cfg.token!r} is not a token of the tokenizer (add "
                             "it as an added token)")
        pipeline = image_pipeline(cfg)
        shape = output_shape(pipeline)
        count = cfg.tokens or (shape[1] // cfg.patch) * (shape[2] // cfg.patch)
        if count < 1:
            raise ValueError(f"images.patch {cfg.patch} is larger than the images "
                             f"({shape[1]}x{shape[2]})")
        return int(token), int(count), pipeline, shape

    # -- the plan --------------------------------------------------------------------------
    def _plan(self, cfg: Any) -> None:
        n = self.seq_len
        lengths = np.diff(self.offsets)
        bad = np.zeros(len(lengths), bool)
        bad[list(self.errors)] = True
        long = (lengths > n) & ~bad
        self.long_conversations = int(long.sum())
        keep = ~bad & (lengths > 0)
        if cfg.long == "drop":
            keep &= ~long
        # A cut could fall inside an image block: a long conversation with images is left out.
        with_images = (np.zeros(len(lengths), bool) if self.images is None
                       else np.diff(self.images.offsets) > 0)
        self.long_with_images = int(np.count_nonzero(long & with_images & keep))
        keep &= ~(long & with_images)
        docs = np.flatnonzero(keep)
        if cfg.long == "split":
            pieces = -(-lengths[docs] // n)
            doc = np.repeat(docs, pieces)
            k = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            p = k * n
            q = np.minimum(p + n, lengths[doc])
        else:
            doc, p, q = docs, np.zeros(len(docs), np.int64), np.minimum(lengths[docs], n)
        self.split = cfg.long == "split"
        rows = (np.arange(len(doc)) if not cfg.pack
                else self._pack(q - p))  # row of each piece
        order = np.lexsort((np.arange(len(doc)), rows))
        self.piece_doc, self.piece_p, self.piece_q = doc[order], p[order], q[order]
        packed = int(rows.max()) + 1 if len(rows) else 0
        self.row_starts = np.searchsorted(rows[order], np.arange(packed + 1)).astype(np.int64)
        # Under raise, each bad record is a row of its own after the packed ones.
        self.error_rows = (np.flatnonzero(bad) if cfg.on_error == "raise"
                           else np.zeros(0, np.int64))
        self.packed_rows = packed
        self.length = packed + len(self.error_rows)
        if self.length == 0:
            raise ValueError(f"{self.storage.url}: no conversation to serve "
                             f"({len(lengths)} records, {len(self.errors)} bad)")
        self.row_tokens = np.concatenate([np.add.reduceat(
            self.piece_q - self.piece_p, self.row_starts[:-1]) if packed else
            np.zeros(0, np.int64), np.zeros(len(self.error_rows), np.int64)]).astype(np.int64)
        self.total_tokens = int(self.row_tokens.sum())
        self.packing_efficiency = self.total_tokens / max(1, packed * n)

    def _pack(self, sizes: np.ndarray) -> np.ndarray:
        """Each piece's row: best fit decreasing within windows of WINDOW pieces."""
        rows = np.empty(len(sizes), np.int64)
        base = 0
        for w in range(0, len(sizes), WINDOW):
            part = sizes[w : w + WINDOW]
            free: list[tuple[int, int]] = []  # (room left, row), sorted
            count = 0
            for i in np.argsort(-part, kind="stable"):
                size = int(part[i])
                j = bisect.bisect_left(free, (size, -1))
                if j < len(free):
                    room, row = free.pop(j)
                else:
                    room, row, count = self.seq_len, count, count + 1
                rows[w + i] = base + row
                if room > size:
                    bisect.insort(free, (room - size, row))
            base += count
        return rows

    def sample_lengths(self) -> np.ndarray:
        """Each row's real tokens (token budgets, `batch_tokens`)."""
        return np.maximum(self.row_tokens, 1)

    # -- rows ------------------------------------------------------------------------------
    def _pieces(self, index: int) -> Iterator[tuple[int, int, int]]:
        if not 0 <= index < self.length:
            raise IndexError(f"row {index} not in [0, {self.length})")
        if index >= self.packed_rows:
            d = int(self.error_rows[index - self.packed_rows])
            raise ValueError(self._error(d, self.errors[d]))
        for j in range(int(self.row_starts[index]), int(self.row_starts[index + 1])):
            yield int(self.piece_doc[j]), int(self.piece_p[j]), int(self.piece_q[j])

    def sample(self, index: int, key: EpochKey | None = None) -> dict[str, np.ndarray]:
        n = self.seq_len
        input_ids, labels, position_ids, document_ids = empty_row(n, self.pad_id)
        t = 0
        for seg, (d, p, q) in enumerate(self._pieces(index)):
            first = int(self.offsets[d])
            last = int(self.offsets[d + 1]) if self.split else first + q
            k = q - p
            input_ids[t : t + k] = self.tokens[first + p : first + q]
            nxt = slice(first + p + 1, min(first + q + 1, last))
            m = nxt.stop - nxt.start
            labels[t : t + m] = np.where(self.trained[nxt] != 0,
                                         self.tokens[nxt].astype(np.int64), IGNORE)
            position_ids[t : t + k] = np.arange(k)
            document_ids[t : t + k] = seg
            t += k
        position_ids[t:] = np.arange(n - t)
        attention_mask = (document_ids >= 0).astype(np.int64)
        row: dict[str, np.ndarray] = {
            "input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "document_ids": document_ids, "attention_mask": attention_mask}
        if self.images is not None:
            self._add_images(row, index, key or EpochKey())
        return row

    def _add_images(self, row: dict[str, Any], index: int, key: EpochKey) -> None:
        """pixel_values [k, 3, H, W] and image_positions [k] (both padded to the batch's
        largest k), image_counts (k): the row's images in order, where each block starts."""
        assert self.images is not None
        images, positions, t = [], [], 0
        for d, p, q in self._pieces(index):
            for j in self.images.of(d):  # whole conversations only: every block inside
                images.append(j)
                positions.append(t + int(self.images.at[j]) - p)
            t += q - p
        row["pixel_values"] = padded(self.images.pixels(images, key.rng(index)), (0,))
        row["image_positions"] = padded(np.asarray(positions, np.int64), (0,))
        row["image_counts"] = np.int64(len(images))

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.sample(index)

    def __len__(self) -> int:
        return self.length

    def _where(self, d: int) -> str:
        f, where = (int(x) for x in self.sources[d])
        key = self.keys[f]
        return f"{self.storage.where(key)} {'line' if key.endswith('.jsonl') else 'row'} {where}"

    def _error(self, d: int, error: str) -> str:
        return f"{self._where(d)}: {error}"

    def source_of(self, index: int) -> str:
        """The conversations row `index` holds (the same for every epoch)."""
        if self.packed_rows <= index < self.length:
            # what its read error names already, so that the error says it once
            return self._where(int(self.error_rows[index - self.packed_rows]))
        parts = [f"{self._where(d)} tokens {p}..{q}" for d, p, q in self._pieces(index)]
        more = f" and {len(parts) - 4} more" if len(parts) > 4 else ""
        return f"row {index}: " + ", ".join(parts[:4]) + more

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return []  # rows read the rendered corpus, mapped at open

    def preview(self, count: int = 2) -> list[str]:
        """Which rule masks the conversations, then the first `count` conversations as the
        model sees them, trained tokens in [[ ]]."""
        out = [self.template.describe()]
        for d in range(min(count, len(self.offsets) - 1)):
            if d in self.errors:
                out.append(f"{self._error(d, self.errors[d])}")
                continue
            a, b = int(self.offsets[d]), int(self.offsets[d + 1])
            ids, flags = self.tokens[a:b].tolist(), self.trained[a:b]
            cuts = [0, *(np.flatnonzero(np.diff(flags)) + 1).tolist(), len(ids)]
            text = "".join(
                ("[[{}]]" if flags[i] else "{}").format(
                    self.tokenizer.decode(ids[i:j], skip_special_tokens=False))
                for i, j in itertools.pairwise(cuts) if j > i)
            out.append(f"{self._where(d)}: {b - a} tokens, {int(flags.sum())} trained: "
                       + json.dumps(text, ensure_ascii=False))
        return out
