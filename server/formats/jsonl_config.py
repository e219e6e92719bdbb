"""The config model of `format: jsonl` (read by formats/jsonl.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .config_base import Fill, LengthColumn, NumberDtype, Sourced, Strict, check_fill, check_text


class JsonField(Strict):
    path: str | None = Field(None, description="dotted key in the record; default: field name")
    # None: inferred at open from the first records (see formats/jsonl.py): int64 when
    # every value seen is an integer, bool when every one is a bool, else float32.
    dtype: Literal[NumberDtype, "utf8"] | None = None  # one Literal: one error line, not two
    # -1 as the first axis: a list of any length (token ids), padded to the batch's longest.
    shape: tuple[int, ...] = ()
    # utf8: the text's bytes as uint8[max_bytes], zero-padded, and `<name>_length` (int64).
    max_bytes: int | None = Field(None, ge=1)
    fill: Fill = None

    @model_validator(mode="after")
    def _utf8_needs_max_bytes(self) -> JsonField:
        check_text(self.dtype == "utf8", self.max_bytes)
        if self.dtype == "utf8" and self.shape:
            raise ValueError("a utf8 field has no shape (it is uint8[max_bytes])")
        check_fill(self.fill, self.dtype == "utf8")
        if any(d < 0 for d in self.shape[1:]) or any(d < -1 for d in self.shape[:1]):
            raise ValueError("shape: -1 (any length) may be the first axis only")
        return self


class JsonlDataset(Sourced):
    """Records, one JSON object per line, from one file or many (a glob); a shard is a file."""

    format: Literal["jsonl"]
    fields: dict[str, JsonField] = Field(min_length=1)
    length_column: str | None = LengthColumn  # a field's name
