"""The config model of `format: jsonl` (read by formats/jsonl.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .config_base import Fill, LengthColumn, NumberDtype, Sourced, Strict, check_fill, check_text
from .image_config import ImageSize, Transforms, size_or_transforms

VIDEO_FRAMES_ONLY = ("time_column", "offsets", "size", "transforms", "layout")


class JsonField(Strict):
    """One output field of a jsonl dataset: where in the record it is and what it becomes.

    Attributes:
        path: A dotted path into the record: `meta.label` walks objects by key, `tokens.0` takes a
            list item by position.
        dtype: The output dtype.
        shape: The value's shape; nested JSON lists for arrays.
        max_bytes: >= 1; required for `utf8`, an error for the other dtypes.
        fill: The value a JSON `null` becomes (inside lists too); pandas' `to_json` writes `NaN` as
            `null`.
        decode: The value is a video file's path (a key under the source's root) and the field is
            frames of it, exactly as parquet's `decode: video_frames`: uint8 `[B, K, 3, H, W]`,
            `<name>_timestamps` and, at native size, `<name>_size`.
        time_column: Required for `video_frames`, an error otherwise: the dotted path of the
            record's time in seconds (a number).
        offsets: `video_frames` only: the frames shown at the record's time plus each offset
            (seconds).
        size: `video_frames` only: a plain resize of the frames.
        transforms: `video_frames` only: the image pipeline, instead of `size`.
        layout: `video_frames` only: `chw` (frames `[K, 3, H, W]`) or `hwc`.
    """

    path: str | None = Field(None, description="dotted key in the record; default: field name")
    # None: inferred at open from the first records (see formats/jsonl.py): int64 when
    # every value seen is an integer, bool when every one is a bool, else float32.
    dtype: Literal[NumberDtype, "utf8"] | None = None  # one Literal: one error line, not two
    # -1 as the first axis: a list of any length (token ids), padded to the batch's longest.
    shape: tuple[int, ...] = ()
    # utf8: the text's bytes as uint8[max_bytes], zero-padded, and `<name>_length` (int64).
    max_bytes: int | None = Field(None, ge=1)
    fill: Fill = None
    # video_frames, as in format: parquet: the field's value is a video's path (a key under
    # the source's root) and `time_column` (a dotted key) a time in seconds; the field is
    # the frames shown at time + each offset.
    decode: Literal["video_frames"] | None = None
    time_column: str | None = Field(None, min_length=1)
    offsets: tuple[float, ...] = Field((0.0,), min_length=1)
    size: ImageSize | None = None
    transforms: Transforms | None = None
    layout: Literal["chw", "hwc"] = "chw"  # tchw or thwc

    @model_validator(mode="after")
    def _video_frames_options(self) -> JsonField:
        if self.decode == "video_frames":
            if self.time_column is None:
                raise ValueError("decode: video_frames needs time_column")
            size_or_transforms(self.size, self.transforms)
            numbers = {"dtype", "shape", "max_bytes", "fill"} & self.model_fields_set
            if numbers:
                raise ValueError(f"{', '.join(sorted(numbers))}: not with decode: video_frames")
        elif set(VIDEO_FRAMES_ONLY) & self.model_fields_set:
            named = sorted(set(VIDEO_FRAMES_ONLY) & self.model_fields_set)
            raise ValueError(f"{', '.join(named)}: only with decode: video_frames")
        return self

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
    """Records, one JSON object per line, from one file or many (a glob); a shard is a file.

    Attributes:
        format: `"jsonl"`: selects this model (the key every dataset gives).
        fields: At least one; output field name -> a column (below).
        length_column: A column (of every file; it need not be a field): each row's token count for
            token budgets (`batch_tokens`), the value of an integer column or the length of a list
            column.
    """

    format: Literal["jsonl"]
    fields: dict[str, JsonField] = Field(min_length=1)
    length_column: str | None = LengthColumn  # a field's name
