"""The config model of `format: python` (read by formats/python.py)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field

from .config_base import DatasetBase, UserTransform


def _field_names(v: list[str] | None) -> list[str] | None:
    if v is not None and (len(set(v)) != len(v) or "sample_index" in v or "" in v):
        raise ValueError("field names must be distinct, non-empty and not 'sample_index'")
    return v


class PythonDataset(DatasetBase):
    """The user's own map-style dataset: `factory` returns an object with __len__ and
    __getitem__(i) -> a dict of fields, a tuple of them or one (formats/python.py).

    Attributes:
        format: `"python"`: selects this model (the key every dataset gives).
        factory: `"module:callable"`, the callable part may be dotted (`pkg.mod:Class.create`).
        options: Keyword arguments for the factory.
        prepare: `"module:callable"`: a deterministic `fn(dataset[i]) -> sample`, the expensive work
            that does not change with the epoch; its output is what the prefix cache keeps.
        fields: The field names of the values a sample tuple holds, in order: `fields: [image,
            label]` for a dataset returning `(image, label)`; distinct, not `sample_index`. null:
            `"0"`, `"1"`, ...
        on_error: A bad sample: fail its batch (`raise`) or replace it deterministically (`skip`).
        transform: `"module:callable"`: the user's per-sample `fn(sample, rng) -> dict`, applied
            after `prepare`, `rng` seeded by (seed, epoch, sample index).
    """

    format: Literal["python"]
    factory: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
                         description='"module:callable", importable on the server')
    options: dict[str, Any] = Field(default_factory=dict)
    # fn(dataset[i]) -> a sample: deterministic work (decode, resize) whose output the prefix
    # cache keeps (cache.decoded_bytes); `transform:` then runs on it every epoch.
    prepare: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
                                description='"module:callable", importable on the server')
    # The names of the values a sample tuple holds, in order (default "0", "1", ...).
    fields: Annotated[list[str] | None, AfterValidator(_field_names)] = None
    on_error: Literal["raise", "skip"] = "raise"
    transform: str | None = UserTransform

    # The user's object: a `storage` it may have does not describe its samples.
    described_by_listing: ClassVar[bool] = False

    @property
    def runs_user_code(self) -> bool:
        return True
