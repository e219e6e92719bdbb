"""The config model of `format: text` (read by formats/text.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .config_base import Sourced, TokenId, Tokenizer


class TextDataset(Sourced):
    """Documents (a string field of .jsonl records or a string column of .parquet files),
    tokenized once at open and packed into rows of seq_len tokens: the documents of an epoch
    concatenated in a (seed, epoch) order and cut every seq_len tokens (see formats/text.py).

    Attributes:
        format: `"text"`: selects this model (the key every dataset gives).
        field: `.jsonl`: a dotted path in each record, as in `jsonl` (`meta.body`); `.parquet`: a
            string column.
        tokenizer: `byte` (built in: UTF-8 bytes are ids 0-255, BOS 256, EOS 257, PAD 258), a
            Hugging Face `tokenizer.json` (any `*.json` file), or a tiktoken BPE ranks file
            (`*.tiktoken`); a local file that must exist when the config is loaded, relative paths
            relative to the config file.
        tiktoken_pattern: `*.tiktoken` only: the pre-tokenizer regex (tiktoken's syntax).
        seq_len: >= 2; tokens per row.
        bos: Prepend BOS to every document.
        eos: Append EOS to every document.
        bos_id: The BOS id; null: the tokenizer's own.
        eos_id: The EOS id; null: the tokenizer's own.
        pad_id: The id that fills the last row.
        long_documents: A document longer than `seq_len` (BOS and EOS counted): cut across rows, or
            left out.
        shuffle: `global` only: rows have no shards.
    """

    format: Literal["text"]
    field: str = Field("text", min_length=1,
                       description="jsonl: a dotted path in each record; parquet: a column")
    tokenizer: Tokenizer = Field("byte", min_length=1,
                           description='"byte", a tokenizer.json (Hugging Face tokenizers) or '
                                       "a *.tiktoken BPE ranks file")
    tiktoken_pattern: str | None = Field(None, description="*.tiktoken only; default cl100k's")
    seq_len: int = Field(ge=2)
    bos: bool = Field(False, description="prepend BOS to every document")
    eos: bool = Field(True, description="append EOS to every document")
    bos_id: TokenId | None = None  # default: the tokenizer's own BOS
    eos_id: TokenId | None = None  # default: the tokenizer's own EOS
    pad_id: TokenId | None = None  # default: the tokenizer's PAD, else the EOS, else 0
    # split: a document longer than seq_len (BOS/EOS included) runs on across rows; drop: left out.
    long_documents: Literal["split", "drop"] = "split"
    shuffle: Literal["global"] = "global"  # rows have no shards

    uses_cache_dir: ClassVar[bool] = True  # the tokenized corpus

    @model_validator(mode="after")
    def _special_ids(self) -> TextDataset:
        tiktoken = self.tokenizer.endswith(".tiktoken")
        if self.tiktoken_pattern is not None and not tiktoken:
            raise ValueError("tiktoken_pattern applies to a *.tiktoken tokenizer only")
        for flag, name in ((self.bos, "bos"), (self.eos, "eos")):
            if tiktoken and flag and getattr(self, f"{name}_id") is None:
                raise ValueError(f"{name}_id is required with {name}: true and a *.tiktoken "
                                 "tokenizer (the file holds no special tokens)")
        return self
