"""The config model of `format: array_record` (read by formats/array_record.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .config_base import Sourced
from .example_config import Decoded, ExampleFeature


class ArrayRecordDataset(Sourced, Decoded):
    """Grain's ArrayRecord files; a shard is a file, sample i the i-th record of the files in
    sorted order. Records are serialized `tf.train.Example`s read through `features:`, or
    raw bytes: one field (`field`, default `record`) decoded as `decode:` says (image, utf8,
    npy; none: the bytes, with max_bytes).

    Attributes:
        format: `"array_record"`: selects this model (the key every dataset gives).
        features: Output field -> the `tf.train.Example` feature it reads; null: raw records, one
            field.
        record: With `features`: `example` or `sequence_example` (`features` then read its context).
        field: Raw records: the output field (default `record`).
        shuffle: `global` (random access by record is cheap) or `block`.
    """

    format: Literal["array_record"]
    features: dict[str, ExampleFeature] | None = Field(None, min_length=1)
    record: Literal["example", "sequence_example"] = "example"  # with features
    field: str = Field("record", min_length=1, description="raw records: the output field")
    shuffle: Literal["global", "block"] = "global"  # random access by record is cheap

    @model_validator(mode="after")
    def _features_or_decode(self) -> ArrayRecordDataset:
        if self.features is not None:
            if (self.decode is not None or self.max_bytes is not None
                    or self.size is not None or self.transforms is not None
                    or self.field != "record"):
                raise ValueError("features (Example records) and decode, max_bytes, size, "
                                 "transforms, field (raw records) exclude each other")
        else:
            self.check_decode()
        return self
