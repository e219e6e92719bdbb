"""The `features:` of `format: tfrecord` and `format: array_record`: output fields read from
the features of serialized `tf.train.Example`s (read by formats/_example.py), and the
`decode:` of a raw bytes record."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .config_base import Strict
from .image_config import ImageSize, Transforms, size_or_transforms

BytesDecode = Literal["image", "utf8", "npy"]


class Decoded(Strict):
    """How a bytes value becomes arrays: `decode: image` (with size or transforms, layout),
    `utf8` (max_bytes), `npy`; none: the raw bytes, cut to max_bytes.

    Attributes:
        decode: How the member's bytes become the field (below).
        size: `image`, `video`: a plain resize, as in image-folder; with neither `size` nor
            `transforms`, the native size (`<name>_size` is added); an error for the others.
        transforms: `image` only: as in image-folder; the image fields of a sample share one
            generator, in field order.
        layout: `image`; `video`: `[T, 3, H, W]` or `[T, H, W, 3]`.
        max_bytes: >= 1; required for `utf8` and for `json` with `dtype: utf8`, an error for the
            others.
    """

    decode: BytesDecode | None = None
    size: ImageSize | None = None  # image: a plain resize
    transforms: Transforms | None = None  # image: instead of size
    layout: Literal["chw", "hwc"] = "chw"  # image
    max_bytes: int | None = Field(None, ge=1)  # utf8 and raw bytes: uint8[max_bytes], length

    def check_decode(self, is_bytes: bool = True) -> None:
        if not is_bytes:
            if self.decode is not None:
                raise ValueError("decode applies to kind bytes only")
        elif self.decode == "image":
            size_or_transforms(self.size, self.transforms)
        if self.decode != "image" and (self.size is not None or self.transforms is not None
                                       or self.layout != "chw"):
            raise ValueError("size, transforms and layout apply to decode: image only")
        text = is_bytes and self.decode in (None, "utf8")
        if text and self.max_bytes is None:
            raise ValueError("max_bytes is required for utf8 text and raw bytes "
                             "(uint8[max_bytes] and <name>_length)")
        if not text and self.max_bytes is not None:
            raise ValueError("max_bytes applies to decode: utf8 and raw bytes only")


class ExampleFeature(Decoded):
    """One output field: the feature `key` (default: the field's name) of each record, a
    list of `kind`, `shape` values (default: one), read as tf.io.FixedLenFeature reads it.

    Attributes:
        kind: `int64` (served int64), `float` (float32, TensorFlow's FloatList), `bytes`.
        shape: The values' shape: the list must hold exactly their product.
        key: The feature's name in the record, e.g. `image/encoded`.
    """

    kind: Literal["int64", "float", "bytes"]
    shape: tuple[int, ...] = Field((), description="[]: a scalar; values = product of shape")
    key: str | None = Field(None, min_length=1, description="the feature's name in the record")

    @model_validator(mode="after")
    def _options(self) -> ExampleFeature:
        if any(n < 1 for n in self.shape):
            raise ValueError(f"shape {list(self.shape)}: every size must be >= 1")
        if self.kind == "bytes" and self.shape:
            raise ValueError("kind bytes reads one value: shape must be [] (a scalar)")
        self.check_decode(self.kind == "bytes")
        return self


Features = dict[str, ExampleFeature]
