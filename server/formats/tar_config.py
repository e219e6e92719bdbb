"""The config model of `format: tar` (read by formats/tar.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .config_base import NumberDtype, Sourced, Strict, check_text
from .image_config import ImageSize, Transforms, size_or_transforms
from .video_config import Clip


class TarField(Strict):
    ext: str = Field(min_length=1, description="the member's extension after the sample key "
                                               "(matched ignoring case, as webdataset does)")
    decode: Literal["image", "int", "float", "npy", "utf8", "json", "video"]
    size: ImageSize | None = None  # image, video: a plain resize
    transforms: Transforms | None = None  # image, video: instead of size
    layout: Literal["chw", "hwc"] = "chw"  # image; video: tchw or thwc
    # video: one clip per sample (as format: video's `clips: random`)
    clip: Clip | None = None
    short: Literal["repeat_last", "error"] = "repeat_last"
    max_bytes: int | None = Field(None, ge=1)  # utf8, and json with dtype utf8, as in jsonl
    # json: the value at `path` (dotted, as in jsonl; default: the whole document), as dtype
    # (required: no silent float) and shape.
    path: str | None = None
    dtype: Literal[NumberDtype, "utf8"] | None = None
    shape: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _decoder_options(self) -> TarField:
        check_text(self.decode == "utf8" or (self.decode == "json" and self.dtype == "utf8"),
                    self.max_bytes)
        if self.decode in ("image", "video"):
            size_or_transforms(self.size, self.transforms)
        elif self.size is not None or self.transforms is not None:
            raise ValueError("size and transforms apply to decode: image and video only")
        if (self.decode == "video") != (self.clip is not None):
            raise ValueError("decode: video needs clip: {frames: T, stride: S} (or fps: F), "
                             "and only it takes one")
        if self.decode == "json" and self.dtype is None:
            raise ValueError("decode: json needs dtype (a number type, or utf8 with max_bytes)")
        if self.decode != "json" and (self.path is not None or self.dtype is not None
                                      or self.shape):
            raise ValueError("path, dtype and shape apply to decode: json only")
        return self


class TarDataset(Sourced):
    """WebDataset-style shards: members `KEY.EXT` grouped into samples by KEY; a shard is a
    tar file."""

    format: Literal["tar"]
    fields: dict[str, TarField] = Field(min_length=1)
    shuffle: Literal["global", "block"] = "block"

    uses_cache_dir: ClassVar[bool] = True  # gzipped shards' uncompressed copies
