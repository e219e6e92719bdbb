"""The config model of `format: litdata` (read by formats/litdata.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .config_base import Sourced
from .mds_config import ColumnField


class LitdataDataset(Sourced):
    """A LitData folder (optimize's index.json and chunks); a shard is a chunk."""

    format: Literal["litdata"]
    fields: dict[str, ColumnField] = Field(min_length=1)
    shuffle: Literal["global", "block"] = "block"
