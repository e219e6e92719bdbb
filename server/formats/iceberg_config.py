"""The config model of `format: iceberg` (read by formats/iceberg.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from ._lake_config import AsOf, LakeDataset
from .config_base import Strict, relative_to_config


class Catalog(Strict):
    """Where the table's metadata is: a SQL catalog (`sql`, SQLite by default: an embedded
    catalog in one file) or an Iceberg REST catalog (`rest`).

    Attributes:
        type: `sql` (SQLAlchemy URI; SQLite embedded) or `rest`.
        uri: `"sqlite:///data/catalog.db"` or the REST catalog's http(s):// address.
        warehouse: Where the tables' files are: a folder or s3://bucket/prefix.
        name: The catalog's name in pyiceberg.
        properties: Any other pyiceberg catalog property (`s3.endpoint`, `token`, ...).
    """

    type: Literal["sql", "rest"] = "sql"
    uri: str = Field(min_length=1, description='"sqlite:///data/catalog.db" or http(s)://...')
    warehouse: str | None = Field(None, description="a folder or s3://bucket/prefix")
    name: str = "default"
    # Any other pyiceberg catalog property (`s3.endpoint`, `token`, `credential`, ...).
    properties: dict[str, str] = Field(default_factory=dict)

    @field_validator("uri")
    @classmethod
    def _sqlite_relative_to_config(cls, v: str, info: ValidationInfo) -> str:
        # sqlite:///relative/path (three slashes) is relative: to the config file, as every
        # local path of the config is.
        prefix = "sqlite:///"
        if v.startswith(prefix) and not v.startswith(prefix + "/") and v != prefix + ":memory:":
            return prefix + relative_to_config(v[len(prefix):], info)
        return v

    @field_validator("warehouse")
    @classmethod
    def _warehouse_relative(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None or "://" in v:
            return v
        return "file://" + str(relative_to_config(v, info))


class IcebergDataset(LakeDataset):
    """An Iceberg table (pyiceberg), at one snapshot: its data files read as format parquet
    reads files, positional deletes applied, renamed columns followed by field id.

    Attributes:
        format: `"iceberg"`: selects this model.
        catalog: The catalog that holds the table (above).
        table: `"namespace.table"`.
        snapshot_id: The snapshot to read (default: the current one at the job's first contact).
        ref: A branch or tag: its snapshot at the job's first contact.
        as_of: A timestamp: the snapshot current then.
    """

    format: Literal["iceberg"]
    catalog: Catalog
    table: str = Field(pattern=r"^[^.\s]+(\.[^.\s]+)+$", description='"namespace.table"')
    snapshot_id: int | None = None
    ref: str | None = Field(None, min_length=1, description="a branch or tag")
    as_of: AsOf = None

    pins: ClassVar[tuple[str, ...]] = ("snapshot_id", "ref", "as_of")
    moving: ClassVar[tuple[str, ...]] = ("ref",)  # a branch moves on (and a tag may be moved)
    not_content: ClassVar[frozenset[str]] = frozenset({"s3", "catalog"})
    library: ClassVar[str] = "pyiceberg"
    module: ClassVar[str] = "pyiceberg"

    def at_snapshot(self, snapshot: str) -> IcebergDataset:
        return self.model_copy(update={"snapshot_id": int(snapshot), "ref": None,
                                       "as_of": None})
