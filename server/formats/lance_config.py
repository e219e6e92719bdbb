"""The config model of `format: lance` (read by formats/lance.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ._lake_config import LakeDataset
from .config_base import Source


class LanceDataset(LakeDataset):
    """A Lance dataset (pylance), at one version: rows read by random access (`take`), so a
    global shuffle costs a row, not a row group; deleted rows left out.

    Attributes:
        format: `"lance"`: selects this model.
        source: The dataset's folder or s3:// URL.
        version: The version to read (default: the current one at the job's first contact).
        tag: A tag naming a version.
        shuffle: `global` by default: random access costs a row.
    """

    format: Literal["lance"]
    source: Source = Field(min_length=1, description="the dataset's folder or s3:// URL")
    version: int | None = Field(None, ge=1)
    tag: str | None = Field(None, min_length=1)
    shuffle: Literal["global", "block"] = "global"

    pins: ClassVar[tuple[str, ...]] = ("version", "tag")
    not_content: ClassVar[frozenset[str]] = frozenset({"s3", "source"})
    library: ClassVar[str] = "pylance"
    module: ClassVar[str] = "lance"

    def at_snapshot(self, snapshot: str) -> LanceDataset:
        return self.model_copy(update={"version": int(snapshot), "tag": None})
