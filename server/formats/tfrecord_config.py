"""The config model of `format: tfrecord` (read by formats/tfrecord.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from .config_base import Sourced
from .example_config import ExampleFeature


class TfrecordDataset(Sourced):
    """TFRecord files of serialized `tf.train.Example`s (or `SequenceExample`s); a shard is
    a file, sample i the i-th record of the files in sorted order.

    Attributes:
        format: `"tfrecord"`: selects this model (the key every dataset gives).
        features: Output field -> the feature it reads (below).
        record: `sequence_example`: the records are `tf.train.SequenceExample`s, and `features` read
            their context.
        compression: `none`, `gzip`, `zlib` (TFRecordDataset's `compression_type`); `auto`: by
            extension, `.gz` GZIP, `.zz` or `.zlib` ZLIB, else none.
        shuffle: `block`: files in a random order, read through in sequence (`shuffle_window` files
            mixed at once), as for tar shards; `global`: any record after any other.
    """

    format: Literal["tfrecord"]
    features: dict[str, ExampleFeature] = Field(min_length=1)
    # example: tf.train.Example; sequence_example: the context features of a SequenceExample
    record: Literal["example", "sequence_example"] = "example"
    # auto: by extension (.gz: GZIP; .zz, .zlib: ZLIB; else none), as TFRecordDataset's
    # compression_type names them.
    compression: Literal["auto", "none", "gzip", "zlib"] = "auto"
    shuffle: Literal["global", "block"] = "block"

    uses_cache_dir: ClassVar[bool] = True  # the offsets index, decompressed files
