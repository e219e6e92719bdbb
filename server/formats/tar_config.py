"""The config model of `format: tar` (read by formats/tar.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .config_base import NumberDtype, Sourced, Strict, check_text
from .image_config import ImageSize, Transforms, size_or_transforms
from .video_config import Clip


class TarField(Strict):
    """One output field of a tar dataset: the member it reads and how it is decoded.

    Attributes:
        ext: The member's extension after the sample key: `jpg`, `cls`, `seg.png`; matched ignoring
            case, as webdataset does (`0001.JPG` is extension `jpg`).
        decode: How the member's bytes become the field (below).
        size: `image`, `video`: a plain resize, as in image-folder; with neither `size` nor
            `transforms`, the native size (`<name>_size` is added); an error for the others.
        transforms: `image` only: as in image-folder; the image fields of a sample share one
            generator, in field order.
        layout: `image`: `chw` or `hwc`; `video`: `tchw` or `thwc`.
        clip: Required for `video`, an error for the others: `{frames: T, stride: S}` or `{frames:
            T, fps: F}` as in format: video; one random clip per sample, its start drawn from (seed,
            epoch, sample index).
        short: `video`: a video shorter than its clip, as in format: video.
        max_bytes: >= 1; required for `utf8` and for `json` with `dtype: utf8`, an error for the
            others.
        path: `json` only: the dotted path of the value (`a.b.0` walks objects by key and lists by
            position, as in jsonl); null: the whole document.
        dtype: `json` only, and required there (no silent float): the value's dtype, as jsonl's
            fields.
        shape: `json` only: the value's shape (a list of lists for `[2, 3]`).
    """

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
    tar file.

    Attributes:
        format: `"tar"`: selects this model (the key every dataset gives).
        fields: At least one; output field name -> the member it reads (TarField).
        shuffle: `global` or `block` (default: shards in a random order, mixed within windows).
    """

    format: Literal["tar"]
    fields: dict[str, TarField] = Field(min_length=1)
    shuffle: Literal["global", "block"] = "block"

    uses_cache_dir: ClassVar[bool] = True  # gzipped shards' uncompressed copies
