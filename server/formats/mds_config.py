"""The config model of `format: mds` (read by formats/mds.py), and the fields it shares with
`format: litdata`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .config_base import Sourced, Strict
from .image_config import ImageSize, Transforms


class ColumnField(Strict):
    """A field of `format: mds` or `format: litdata`: one column of the peer's samples,
    decoded as its encoding says (see docs/configuration.md); the options that apply depend
    on that encoding, known when the dataset opens.

    Attributes:
        column: The column it reads; null: the field's name.
        size: Image columns: a plain resize.
        transforms: Image columns: the image pipeline, instead of size.
        layout: Image columns: `chw` or `hwc`.
        max_bytes: >= 1; str and bytes columns, as utf8 in jsonl.
    """

    column: str | None = Field(None, description="default: the field name")
    size: ImageSize | None = None  # image columns: a plain resize
    transforms: Transforms | None = None  # image columns: instead of size
    layout: Literal["chw", "hwc"] = "chw"  # image columns
    max_bytes: int | None = Field(None, ge=1)  # str and bytes columns, as utf8 in jsonl

    @model_validator(mode="after")
    def _one_geometry(self) -> ColumnField:
        if self.size is not None and self.transforms is not None:
            raise ValueError("give either size (a plain resize) or transforms, not both")
        return self


class MdsDataset(Sourced):
    """A Mosaic Streaming folder (MDSWriter's index.json and shards); a shard is a shard.

    Attributes:
        format: `"mds"`: selects this model (the key every dataset gives).
        fields: At least one; output field name -> a column (ColumnField).
        shuffle: `global` or `block` (default: shards in a random order, mixed within windows).
    """

    format: Literal["mds"]
    fields: dict[str, ColumnField] = Field(min_length=1)
    shuffle: Literal["global", "block"] = "block"
