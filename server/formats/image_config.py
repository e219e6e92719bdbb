"""What an image field may say: its output size, or an ordered list of transforms (`name:
{arguments}` steps, one model each), for image-folder and the image fields of tar, parquet,
mds and litdata. server/images.py runs the steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from .config_base import Strict


def _square(v: Any) -> Any:
    return (v, v) if isinstance(v, int) and not isinstance(v, bool) else v


def _positive_size(v: tuple[int, int]) -> tuple[int, int]:
    if min(v) < 1:
        raise ValueError("sizes must be >= 1")
    return v


ImageSize = Annotated[tuple[int, int], BeforeValidator(_square), AfterValidator(_positive_size),
                      Field(description="output [height, width], or one int for square")]


# -- transforms: an ordered list of one-key mappings `name: {arguments}` -----------------------
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _none_is_empty(v: Any) -> Any:
    return {} if v is None else v  # `- horizontal_flip:` with nothing after it


class ResizeArgs(Strict):
    """The arguments of `resize` (an int alone is `size`).

    Attributes:
        size: An int: the shorter side becomes `size`; a pair: exactly that size (height, width).
        antialias: False: plain bilinear, faster, aliases.
    """

    size: int | tuple[int, int] = Field(
        description="int: the shorter side (aspect kept); [height, width]: exactly")
    antialias: bool = Field(True, description="false: plain bilinear, faster, aliases")

    @model_validator(mode="before")
    @classmethod
    def _short(cls, v: Any) -> Any:
        """`short: 256` is `size: 256` (the shorter side, FFCV's "max resolution" spelling)."""
        if isinstance(v, dict) and "short" in v:
            if "size" in v:
                raise ValueError("give either size or short, not both")
            if not isinstance(v["short"], int) or isinstance(v["short"], bool):
                raise ValueError(f"short: the shorter side in pixels, one int, got {v['short']!r}")
            v = {("size" if k == "short" else k): x for k, x in v.items()}
        return v

    @field_validator("size")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if min(v if isinstance(v, tuple) else (v,)) < 1:
            raise ValueError("sizes must be >= 1")
        return v


class CenterCropArgs(Strict):
    """The arguments of `center_crop` (an int alone is `size`).

    Attributes:
        size: The middle `size` (an int: square; or height, width) of the image at that step.
    """

    size: ImageSize


def _ordered_range(v: tuple[float, float]) -> tuple[float, float]:
    if not 0 < v[0] <= v[1]:
        raise ValueError(f"expected 0 < low <= high, got {list(v)}")
    return v


Range = Annotated[tuple[float, float], AfterValidator(_ordered_range)]


class RandomResizedCropArgs(Strict):
    """As torchvision's RandomResizedCrop: area fraction in `scale`, aspect in `ratio`.

    Attributes:
        size: The output size (an int: square; or height, width).
        scale: The crop's area fraction, drawn uniform in this range.
        ratio: The crop's aspect ratio, drawn log-uniform in this range.
        antialias: False: plain bilinear, faster, aliases.
    """

    size: ImageSize
    scale: Range = (0.08, 1.0)
    ratio: Range = (3 / 4, 4 / 3)
    antialias: bool = Field(True, description="false: plain bilinear, faster, aliases")

    @field_validator("scale")
    @classmethod
    def _fraction(cls, v: tuple[float, float]) -> tuple[float, float]:
        if v[1] > 1:
            raise ValueError(f"scale is a fraction of the image's area, at most 1, got {list(v)}")
        return v


class FlipArgs(Strict):
    """The arguments of `horizontal_flip`.

    Attributes:
        p: Probability of mirroring.
    """

    p: float = Field(0.5, ge=0, le=1, description="probability of mirroring")


def _positive_std(v: tuple[float, float, float]) -> tuple[float, float, float]:
    if min(v) <= 0:
        raise ValueError("std must be > 0")
    return v


class NormalizeArgs(Strict):
    """(pixel / 255 - mean) / std per channel; output CHW in `dtype`.

    Attributes:
        mean: Per channel, of pixels scaled to [0, 1] (default ImageNet's).
        std: Per channel, > 0 (default ImageNet's).
        dtype: The output dtype: `float32` or `float16`.
    """

    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: Annotated[tuple[float, float, float], AfterValidator(_positive_std)] = IMAGENET_STD
    dtype: Literal["float32", "float16"] = "float32"


# One model per transform, its single field named like it (module-level: configs are pickled
# to the worker processes).
_Args = BeforeValidator(_none_is_empty)


class ResizeStep(Strict):
    """A `resize:` step of `transforms:`.

    Attributes:
        resize: Int: the shorter side becomes `size`, the other `int(size x long / short)`; a pair:
            exactly that size.
    """

    resize: Annotated[ResizeArgs, _Args]


class CenterCropStep(Strict):
    """A `center_crop:` step of `transforms:`.

    Attributes:
        center_crop: The middle `size` of the image at that step (larger than the image: a sample
            error; resize first).
    """

    center_crop: Annotated[CenterCropArgs, _Args]


class RandomResizedCropStep(Strict):
    """A `random_resized_crop:` step of `transforms:`.

    Attributes:
        random_resized_crop: A crop of area fraction uniform in `scale` and aspect log-uniform in
            `ratio` (ten tries, then the central crop clamped to `ratio`), resized to `size`.
    """

    random_resized_crop: Annotated[RandomResizedCropArgs, _Args]


class HorizontalFlipStep(Strict):
    """A `horizontal_flip:` step of `transforms:`.

    Attributes:
        horizontal_flip: Mirrors with probability `p`.
    """

    horizontal_flip: Annotated[FlipArgs, _Args]


class NormalizeStep(Strict):
    """A `normalize:` step of `transforms:`.

    Attributes:
        normalize: `(pixel / 255 - mean) / std` per channel; output float CHW.
    """

    normalize: Annotated[NormalizeArgs, _Args]


TRANSFORMS: dict[str, type[Strict]] = {"resize": ResizeStep, "center_crop": CenterCropStep,
              "random_resized_crop": RandomResizedCropStep,
              "horizontal_flip": HorizontalFlipStep, "normalize": NormalizeStep}


def _transform_name(v: Any) -> str | None:
    if isinstance(v, dict):
        return next(iter(v)) if len(v) == 1 and next(iter(v)) in TRANSFORMS else None
    if isinstance(v, BaseModel):  # a validated step
        return next(iter(type(v).model_fields), None)
    return None  # `- resize` (a bare name), a number...: the error names the step


# Built from TRANSFORMS at run time, which a type checker cannot follow: it sees what every
# step is, a Strict model.
if TYPE_CHECKING:
    TransformStep = Strict
else:
    TransformStep = Annotated[
        Union[tuple(Annotated[m, Tag(n)] for n, m in TRANSFORMS.items())],  # noqa: UP007
        Discriminator(_transform_name, custom_error_type="transform",
                      custom_error_message="each transform is a one-key mapping `name: "
                                           f"{{arguments}}` with name one of "
                                           f"{', '.join(TRANSFORMS)}")]


def transform_steps(steps: list[Any]) -> list[tuple[str, Any]]:
    """(name, arguments) of each validated step, in order."""
    return [(name, getattr(step, name)) for step in steps
            for name in type(step).model_fields]


def _check_transforms(steps: list[Any]) -> list[Any]:
    names = [n for n, _ in transform_steps(steps)]
    if "normalize" in names[:-1]:
        raise ValueError("normalize must be the last transform (its output is float CHW)")
    if not {"center_crop", "random_resized_crop"} & set(names) and not any(
            n == "resize" and isinstance(a.size, tuple) for n, a in transform_steps(steps)):
        raise ValueError("transforms must give every image the same size: include "
                         "center_crop, random_resized_crop, or resize with [height, width]")
    return steps


Transforms = Annotated[list[TransformStep], AfterValidator(_check_transforms),
                       Field(min_length=1)]


def size_or_transforms(size: Any, transforms: Any) -> None:
    # Neither: images at their native size, each batch padded to its largest (images.py).
    if size is not None and transforms is not None:
        raise ValueError("give either size (a plain resize) or transforms, not both")
