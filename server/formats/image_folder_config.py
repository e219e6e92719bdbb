"""The config model of `format: image-folder` (read by formats/image_folder.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .config_base import Sourced
from .image_config import ImageSize, Transforms, size_or_transforms


class ImageFolderDataset(Sourced):
    """One sub-folder per class under `source` (class index = sorted folder order), or the
    images and labels a `manifest` lists.

    Attributes:
        format: `"image-folder"`: selects this model (the key every dataset gives).
        size: Each >= 1; one int means square: a plain resize to exactly this size.
        transforms: The image pipeline, below; replaces `size`.
        layout: Layout of a uint8 `image`; after `normalize` it is always CHW.
        manifest: A key under `source` naming a list of samples (below); null: class sub-folders.
    """

    format: Literal["image-folder"]
    size: ImageSize | None = None
    transforms: Transforms | None = Field(
        None, description="ordered list replacing `size`; see docs/configuration.md")
    layout: Literal["chw", "hwc"] = Field("chw", description="uint8 output; normalize: CHW")
    manifest: str | None = Field(
        None, description="key under source of a CSV (path,label) or JSON lines "
                          '({"path": ..., "label": ...}) file; paths relative to source')

    @model_validator(mode="after")
    def _one_geometry(self) -> ImageFolderDataset:
        size_or_transforms(self.size, self.transforms)
        return self
