"""The config model of `format: memmap` (read by formats/memmap.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .config_base import Sourced


class MemmapDataset(Sourced):
    """Arrays whose first axis is the sample: .npy files, or raw arrays with stoker's small
    header (see formats/memmap.py). Each field's files are concatenated along axis 0 in key
    order; a shard is a file of the first field.

    Attributes:
        format: `"memmap"`: selects this model (the key every dataset gives).
        fields: The field names of the values a sample tuple holds, in order: `fields: [image,
            label]` for a dataset returning `(image, label)`; distinct, not `sample_index`. null:
            `"0"`, `"1"`, ...
    """

    format: Literal["memmap"]
    fields: dict[str, str] = Field(min_length=1, description="field -> glob under source")
