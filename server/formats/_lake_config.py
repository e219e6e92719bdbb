"""What the config models of the lake formats (`format: iceberg`, `delta`, `lance`) share: the
columns a job reads and how they decode, as parquet's; and the snapshot pin.

A lake table moves (appends, deletes, schema changes); a job reads one snapshot of it, the
one its config pins (`snapshot_id`, `ref`, `as_of`; `version`, `tag`) or else the current one
when the job first makes contact. The snapshot is a coordinate (docs/design.md, "Tables in
lakes"): the pin keys are left out of the fingerprint's config content, which holds the
snapshot the pin resolved to instead, so a config pinning `ref: main` and a server opening
that snapshot by id agree.

Light: pydantic only, as every config module.
"""

from __future__ import annotations

import datetime
import importlib.util
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, model_validator

from .config_base import DatasetBase, LengthColumn, S3Settings, UserTransform
from .parquet_config import ParquetField

DECODES = ("image", "utf8", "tokens", "video", "video_frames")


def _zoned(v: datetime.datetime | None) -> datetime.datetime | None:
    if v is not None and v.tzinfo is None:
        raise ValueError("give a time zone, e.g. 2026-12-01T00:00:00Z")
    return v


# `as_of`: the snapshot current at this time (ISO 8601, with its time zone).
AsOf = Annotated[datetime.datetime | None, AfterValidator(_zoned),
                 Field(description="the snapshot current at this time")]


def _installed(module: str) -> bool:
    """Whether `module` can be imported (looked up, not imported: config models stay light)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses it
        return False


class LakeDataset(DatasetBase):
    """`columns:` (each a field of the same name) with `decode:` per column, or parquet's
    `fields:` (output name -> a column and its options); `length_column`, `shuffle`,
    `on_error`, `transform` as in format: parquet.

    Attributes:
        columns: The columns to read, each a field of the same name (or give `fields:`).
        decode: Column -> a decode (`image`, `utf8`, ...) or a mapping of parquet's field
            options (`{decode: image, size: 224}`).
        fields: Parquet's form: output field name -> a column and its options.
        length_column: A column whose value (or list length) is each row's token count.
        shuffle: `global` (a random row anywhere) or `block` (row groups in a random order,
            mixed within windows).
        shuffle_window: Row groups mixed together under `shuffle: block`.
        on_error: `raise` (DATA_LOSS naming the row and file) or `skip` (a replacement row).
        transform: A user transform, as in format: parquet.
        s3: Overrides the top-level `s3:` block for this table's files.
    """

    # Config keys that pin the snapshot (each format's own), and those that say where the
    # table is, not what it holds: neither is in the fingerprint's config content.
    pins: ClassVar[tuple[str, ...]] = ()
    moving: ClassVar[tuple[str, ...]] = ()  # pins that name a snapshot that moves on
    not_content: ClassVar[frozenset[str]] = frozenset({"s3"})
    # The library a dataset of this format needs (its distribution and import names).
    library: ClassVar[str] = ""
    module: ClassVar[str] = ""

    columns: list[str] | None = Field(None, min_length=1)
    # column -> a decode (`image`, `utf8`, ...), or a mapping of parquet's field options
    # (`{decode: image, size: 224}`, `{decode: utf8, max_bytes: 256}`).
    decode: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    fields: dict[str, ParquetField] | None = Field(None, min_length=1)
    length_column: str | None = LengthColumn
    shuffle: Literal["global", "block"] = "block"
    shuffle_window: int = Field(4, ge=1)
    on_error: Literal["raise", "skip"] = "raise"
    transform: str | None = UserTransform
    s3: S3Settings | None = Field(None, description="overrides the top-level s3: block")

    @model_validator(mode="before")
    @classmethod
    def _columns_to_fields(cls, data: Any) -> Any:
        """`columns` and `decode` become `fields` (what the parquet reader takes)."""
        if not isinstance(data, dict) or data.get("columns") is None:
            return data
        columns, decode = data["columns"], data.get("decode") or {}
        if data.get("fields") is not None:
            raise ValueError("give columns (with decode) or fields, not both")
        if not isinstance(columns, list) or not isinstance(decode, dict):
            return data  # the field types name what is wrong
        unknown = sorted(set(decode) - set(map(str, columns)))
        if unknown:
            raise ValueError(f"decode: {unknown} not among the columns {columns}")
        fields = {}
        for c in columns:
            how = decode.get(c)
            if isinstance(how, str):
                if how not in DECODES:
                    raise ValueError(f"decode.{c}: {how!r}: expected one of {list(DECODES)}, or "
                                     "a mapping of parquet's field options")
                how = {"decode": how}
            fields[str(c)] = dict(how or {})
        return {**data, "fields": fields}

    @model_validator(mode="after")
    def _one_pin(self) -> LakeDataset:
        if self.fields is None:
            raise ValueError("columns (a list of the table's columns) or fields is required")
        if self.module and not _installed(self.module):
            raise ValueError(f"format: {self.format} needs {self.library}, which is not "
                             "installed: install stoker's `lake` extra "
                             "(pip install 'stoker[lake]')")
        given = [p for p in self.pins if getattr(self, p) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: give at most one (none: the current "
                             "snapshot when a job first makes contact)")
        return self

    def check_among(self, name: str, datasets: Mapping[str, DatasetBase]) -> None:
        drawn = sorted(n for n, c in datasets.items() if name in c.draws_from)
        if drawn:
            raise ValueError(f"datasets.{drawn[0]}: draws from {name!r}, a lake table: a "
                             "mixture of lake tables is not served (each job reads its own "
                             "snapshot of a table)")

    @property
    def pinned(self) -> bool:
        """Whether the config pins one snapshot, which alone this server serves (a snapshot
        id, a version, a tag, a time). A branch (`ref`) moves: like no pin, it is what a new
        job gets, and a running job's snapshot is served by time travel."""
        return any(getattr(self, p) is not None for p in self.pins if p not in self.moving)

    def at_snapshot(self, snapshot: str) -> LakeDataset:
        """This config pinned to `snapshot` (a SnapshotRef's `id`) by its exact id."""
        raise NotImplementedError
