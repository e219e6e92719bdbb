"""Tokenizers for `format: text`, chosen by the `tokenizer:` setting:

- `byte`: built in. A document's UTF-8 bytes are its ids (0..255); BOS = 256, EOS = 257,
  PAD = 258 (vocabulary 259). A lone surrogate in the text becomes `?`.
- `*.json`: a Hugging Face `tokenizer.json` (the `tokenizers` package). Documents are encoded
  without the tokenizer's own template (`add_special_tokens=False`) and special-token text
  inside a document is encoded as plain text, so a document cannot inject an EOS. BOS, EOS
  and PAD default to the first added token named like one (BOS_NAMES, EOS_NAMES, PAD_NAMES).
- `*.tiktoken`: a tiktoken BPE ranks file (a line per token: base64 of its bytes, a space, its
  rank), split by `tiktoken_pattern` (default cl100k's). The file has no special tokens:
  `bos_id`/`eos_id` must be configured when used (checked with the config).

`encode(texts)` returns every id of the batch in one int64 array and each text's count, so the
caller keeps numpy arrays, not a Python list per document. The optional packages are imported
only when a dataset names such a file.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

BYTE = "byte"
BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258

# cl100k_base's pre-tokenizer regex, as tiktoken_ext.openai_public defines it.
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
                  r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")

# Added tokens of a tokenizer.json taken as its BOS / EOS / PAD, first match wins.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "[BOS]")
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


def _flatten(ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum()))
    return flat, lengths


class Tokenizer:
    """What `format: text` needs of a tokenizer. `fingerprint` changes whenever the ids a
    text gets could change (file contents, pattern, library version)."""

    kind: str
    fingerprint: str
    vocab_size: int
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(all ids, int64, the texts' one after another; each text's id count, int64)."""
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    kind = BYTE
    fingerprint = "byte-1"
    vocab_size = 259
    bos_id, eos_id, pad_id = BYTE_BOS, BYTE_EOS, BYTE_PAD

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        data = [t.encode("utf-8", "replace") for t in texts]
        lengths = np.fromiter(map(len, data), np.int64, len(data))
        return np.frombuffer(b"".join(data), np.uint8).astype(np.int64), lengths


class HFTokenizer(Tokenizer):
    kind = "tokenizers"

    def __init__(self, path: Path, raw: bytes) -> None:
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        if hasattr(self._tok, "encode_special_tokens"):  # tokenizers >= 0.15
            self._tok.encode_special_tokens = True
        self.fingerprint = f"tokenizers-{tokenizers.__version__}-{_sha(raw)}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        self.bos_id, self.eos_id, self.pad_id = (
            next((added[n] for n in names if n in added), None)
            for names in (BOS_NAMES, EOS_NAMES, PAD_NAMES))
        self._fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return _flatten([e.ids for e in self._fast(texts, add_special_tokens=False)])


class TiktokenTokenizer(Tokenizer):
    kind = "tiktoken"

    def __init__(self, path: Path, raw: bytes, pattern: str | None) -> None:
        import tiktoken

        ranks: dict[bytes, int] = {}
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise ValueError(f"{path} line {n}: expected base64 token bytes, a space and a "
                                 "rank") from None
        missing = {bytes([b]) for b in range(256)} - ranks.keys()
        if missing:
            raise ValueError(f"{path}: {len(missing)} of the 256 single bytes have no rank (a "
                             "byte-level BPE needs all of them)")
        pattern = pattern or CL100K_PATTERN
        try:
            self._enc = tiktoken.Encoding(path.stem, pat_str=pattern, mergeable_ranks=ranks,
                                          special_tokens={})
        except ValueError as e:  # the pattern does not compile
            raise ValueError(f"{path}: tiktoken_pattern: {e}") from None
        self.fingerprint = f"tiktoken-{tiktoken.__version__}-{_sha(raw)}-{_sha(pattern.encode())}"
        self.vocab_size = max(ranks.values()) + 1
        self._threads = max(1, len(os.sched_getaffinity(0)))

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return _flatten(self._enc.encode_ordinary_batch(texts, num_threads=self._threads))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_tokenizer(spec: str, tiktoken_pattern: str | None = None) -> Tokenizer:
    """`byte`, or the tokenizer in a local `*.json` (Hugging Face) or `*.tiktoken` file."""
    if spec == BYTE:
        return ByteTokenizer()
    path = Path(spec)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"tokenizer {spec}: cannot read: {e.strerror}") from None
    try:
        if path.suffix == ".tiktoken":
            return TiktokenTokenizer(path, raw, tiktoken_pattern)
        return HFTokenizer(path, raw)
    except ImportError as e:
        raise ValueError(f"tokenizer {spec}: {e.name} is not installed (pip install "
                         "'stoker[text]')") from None
    except ValueError as e:
        if str(path) in str(e):  # ours: names the file already
            raise
        raise ValueError(f"tokenizer {spec}: cannot load: {e}") from None
    except Exception as e:  # the libraries' own parse errors
        raise ValueError(f"tokenizer {spec}: cannot load: {type(e).__name__}: {e}") from None
