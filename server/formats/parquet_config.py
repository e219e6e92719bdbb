"""The config model of `format: parquet` (read by formats/parquet.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .config_base import (
    Fill,
    LengthColumn,
    NumberDtype,
    Sourced,
    Strict,
    TokenId,
    Tokenizer,
    check_fill,
    check_text,
)
from .image_config import ImageSize, Transforms, size_or_transforms
from .video_config import Clip


class ParquetField(Strict):
    """A column -> a field: numbers as they are (no `decode`), or decoded like tar members:
    `image` (binary, or a Hugging Face `Image()` struct<bytes, path>), `utf8` or `tokens`
    (string columns).

    Attributes:
        column: A top-level column of every file; two fields may read one column.
        dtype: Number columns (no `decode`) only: the output dtype; an integer or bool dtype takes
            only values it holds exactly.
        decode: How the column's values become the field (below), as tar's `decode`.
        size: `image`: a plain resize, as in image-folder; with neither `size` nor `transforms`, the
            native size (`<name>_size` is added); an error for the others.
        transforms: `image` only: as in image-folder; the image fields of a sample share one
            generator, in field order.
        layout: `image`; `video_frames`: `[K, 3, H, W]` or `[K, H, W, 3]`.
        time_column: Required for `video_frames`, an error for the others: a column of numbers, each
            row's time in seconds.
        offsets: `video_frames` only: the frames shown at the row's time plus each offset (e.g.
            `[-0.1, 0.0]`).
        clip: Required for `video`, an error for the others: as in format: tar.
        short: `video`: as in format: video.
        max_bytes: >= 1; required for `utf8`, an error for the others.
        tokenizer: `tokens` only: as in text (`byte`, a `tokenizer.json`, a `*.tiktoken` file).
        tiktoken_pattern: `tokens` with a `*.tiktoken` tokenizer only.
        max_tokens: >= 1; required for `tokens`: ids kept per row.
        pad_id: `tokens` only: fills the row after its last id.
        fill: The value a null becomes (a pandas `NaN` or `None` is stored as a null); not for
            `image`.
    """

    column: str | None = Field(None, description="default: the field name")
    dtype: NumberDtype | None = Field(None, description="default: the column's own type")
    decode: Literal["image", "utf8", "tokens", "video", "video_frames"] | None = None
    size: ImageSize | None = None  # image, video_frames: a plain resize
    transforms: Transforms | None = None  # image, video_frames: instead of size
    layout: Literal["chw", "hwc"] = "chw"  # image; video_frames: tchw or thwc
    # video_frames: the column holds a video's path (a key under the source's root), this
    # column a time in seconds; the field is the frames shown at time + each offset.
    time_column: str | None = Field(None, min_length=1)
    offsets: tuple[float, ...] = Field((0.0,), min_length=1)
    # video (a binary column of video files): one clip per row, as format: tar's
    clip: Clip | None = None
    short: Literal["repeat_last", "error"] = "repeat_last"
    max_bytes: int | None = Field(None, ge=1)  # utf8, as in jsonl
    # tokens: the string's ids as int64[max_tokens], padded with pad_id, and `<name>_length`.
    tokenizer: Tokenizer = Field("byte", min_length=1, description="as in format: text")
    tiktoken_pattern: str | None = None  # tokens, *.tiktoken only
    max_tokens: int | None = Field(None, ge=1)
    pad_id: TokenId | None = None  # default: the tokenizer's PAD, else its EOS, else 0
    fill: Fill = None

    @model_validator(mode="after")
    def _decoder_options(self) -> ParquetField:
        check_text(self.decode == "utf8", self.max_bytes)
        if self.decode in ("image", "video", "video_frames"):
            size_or_transforms(self.size, self.transforms)
        elif (self.size is not None or self.transforms is not None
              or "layout" in self.model_fields_set):
            raise ValueError("size, transforms and layout apply to decode: image, video and "
                             "video_frames only")
        if (self.decode == "video") != (self.clip is not None):
            raise ValueError("decode: video needs clip: {frames: T, stride: S} (or fps: F), "
                             "and only it takes one")
        if (self.decode == "video_frames") != (self.time_column is not None):
            raise ValueError("decode: video_frames needs time_column (and only it takes one)")
        if "offsets" in self.model_fields_set and self.decode != "video_frames":
            raise ValueError("offsets apply to decode: video_frames only")
        if self.dtype is not None and self.decode is not None:
            raise ValueError("dtype applies to number columns (no decode) only")
        tokens_only = {"tokenizer", "tiktoken_pattern", "max_tokens", "pad_id"}
        if self.decode == "tokens":
            if self.max_tokens is None:
                raise ValueError("max_tokens is required for decode: tokens")
            if self.tiktoken_pattern is not None and not self.tokenizer.endswith(".tiktoken"):
                raise ValueError("tiktoken_pattern applies to a *.tiktoken tokenizer only")
        elif tokens_only & self.model_fields_set:
            raise ValueError(f"{', '.join(sorted(tokens_only & self.model_fields_set))}: "
                             "only with decode: tokens")
        if self.decode in ("image", "video", "video_frames") and self.fill is not None:
            raise ValueError("an image or video has no fill: a null one fails its sample")
        check_fill(self.fill, self.decode in ("utf8", "tokens"))
        return self


class ParquetDataset(Sourced):
    """Parquet files (pyarrow): columns -> fields, read by row group; a shard is a row group.

    Attributes:
        format: `"parquet"`: selects this model (the key every dataset gives).
        fields: At least one; output field name -> a column (below).
        shuffle: `global` or `block` (default: row groups' files in a random order, mixed within
            windows).
        length_column: A column (of every file; it need not be a field): each row's token count for
            token budgets (`batch_tokens`), the value of an integer column or the length of a list
            column.
    """

    format: Literal["parquet"]
    fields: dict[str, ParquetField] = Field(min_length=1)
    shuffle: Literal["global", "block"] = "block"
    length_column: str | None = LengthColumn  # a column's name
