"""The config model of `format: litdata` (read by formats/litdata.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .config_base import Sourced
from .mds_config import ColumnField


class LitdataDataset(Sourced):
    """A LitData folder (optimize's index.json and chunks); a shard is a chunk.

    Attributes:
        format: `"litdata"`: selects this model (the key every dataset gives).
        fields: At least one; output field name -> a column (ColumnField).
        shuffle: `global` or `block` (default: chunks in a random order, mixed within windows).
    """

    format: Literal["litdata"]
    fields: dict[str, ColumnField] = Field(min_length=1)
    shuffle: Literal["global", "block"] = "block"
