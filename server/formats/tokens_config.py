"""The config model of `format: tokens` (read by formats/tokens.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .config_base import Sourced


class TokensDataset(Sourced):
    """nanoGPT-style flat token files: sample i is a window of seq_len + 1 tokens, giving
    `input_ids` (the first seq_len) and `labels` (the last seq_len); windows step by seq_len
    and never cross a file; a shard is a file.

    Attributes:
        format: `"tokens"`: selects this model (the key every dataset gives).
        dtype: The files' token type.
        seq_len: >= 1; tokens per sample.
        header_bytes: >= 0; bytes skipped at the start of every file.
        output_dtype: Dtype of `input_ids` and `labels`.
        vocab_size: 1 to 2³²; every id must be below it: checked on each file's first tokens at
            start and on every window read.
    """

    format: Literal["tokens"]
    dtype: Literal["uint16", "uint32"] = "uint16"
    seq_len: int = Field(ge=1)
    header_bytes: int = Field(0, ge=0, description="bytes to skip at the start of each file")
    output_dtype: Literal["int32", "int64"] = "int64"
    # Token ids must be below it: checked on each file's first tokens at open and on every
    # window read (None: only the dtype's own range).
    vocab_size: int | None = Field(None, ge=1, le=2**32)
