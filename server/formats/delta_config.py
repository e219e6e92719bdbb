"""The config model of `format: delta` (read by formats/delta.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ._lake_config import AsOf, LakeDataset
from .config_base import Source


class DeltaDataset(LakeDataset):
    """A Delta Lake table (deltalake, delta-rs), at one version: its data files read as
    format parquet reads files. A feature delta-rs does not expose to stoker (deletion
    vectors in use, column mapping) refuses the table, naming it.

    Attributes:
        format: `"delta"`: selects this model.
        source: The table's folder or s3:// URL.
        version: The table version to read (default: the current one at the job's first contact).
        as_of: A timestamp: the version current then.
    """

    format: Literal["delta"]
    source: Source = Field(min_length=1, description="the table's folder or s3:// URL")
    version: int | None = Field(None, ge=0)
    as_of: AsOf = None

    pins: ClassVar[tuple[str, ...]] = ("version", "as_of")
    not_content: ClassVar[frozenset[str]] = frozenset({"s3", "source"})
    library: ClassVar[str] = "deltalake"
    module: ClassVar[str] = "deltalake"

    def at_snapshot(self, snapshot: str) -> DeltaDataset:
        return self.model_copy(update={"version": int(snapshot), "as_of": None})
