"""What the server asks of a dataset: the `Dataset` protocol, and its optional parts looked
up once, when the dataset opens.

Every format, and every `format: python` factory, returns a `Dataset`. What else it may have is
the fields of `DatasetParts`, named and described there and nowhere else; a part the dataset
lacks is None there, and the server goes on without it (no prefetch, no block shuffle...). The
lookup is by name, so a misspelled part would silently be absent: tests/test_dataset_contract.py
checks that every format in `FORMATS` has the parts it is meant to have, and no public name
that is only a misspelling of one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..order.sampling import EpochKey
from ..sources import Storage


class Dataset(Protocol):
    """A map-style dataset: `len()` samples, sample i a dict of field name -> numpy array,
    numpy scalar or Python number."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> dict[str, Any]: ...


@runtime_checkable
class DrawnFrom(Dataset, Protocol):
    """A dataset made of the config's other datasets (its `draws_from`, e.g. a mixture): its
    order and token lengths follow from theirs, given in the order of `names`."""

    names: list[str]

    def ordering(self, components: list[Any]) -> Any: ...
    def lengths(self, components: list[np.ndarray | None]) -> np.ndarray | None: ...


class Sampled:
    """A base for a format read through `sample(index, key)` over `length` samples: `len()`
    is `length`, and `ds[i]` is sample i as the first epoch's key gives it."""

    length: int

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.sample(index, EpochKey())

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class DatasetParts:
    """An opened dataset and its optional parts, each the dataset's attribute of that name or
    None. Holds bound methods: it stays in the process that opened the dataset."""

    dataset: Dataset
    # sample(i, key) -> dict: called instead of `dataset[i]` with the batch's EpochKey
    # (seed, epoch, shuffle), for augmentation (`key.rng(i)`) and packing.
    sample: Callable[[int, EpochKey], dict[str, Any]] | None = None
    # source_of(i) -> str: where sample i comes from, for error messages (file or object URL,
    # and the line, tar member or row inside it).
    source_of: Callable[[int], str] | None = None
    # place_of(i) -> dict: what source_of says, by part, for provenance (ProvenanceRequest):
    # "file" (path or URL), "offset" and "nbytes" (the bytes read for the sample in it), and
    # the format's own ("line", "row_group", "row", "member"; a mixture's "component",
    # "component_index"), each where the format knows it cheaply. No sample is read.
    place_of: Callable[[int], dict[str, Any]] | None = None
    # An int64 array, ascending, starting at 0: the first sample of each shard (file, tar
    # shard, row group), which `shuffle: block` permutes.
    shard_starts: np.ndarray | None = None
    # objects_of(indices) -> list[str]: the storage keys those samples read, which the server
    # fetches ahead of time from `storage` (see Storage.prefetch). Needs `storage`.
    objects_of: Callable[[np.ndarray], list[str]] | None = None
    # The Storage the dataset reads through (formats read bytes only through one).
    storage: Storage | None = None
    # fingerprint() -> str: `format: python` datasets only: a string that changes whenever the
    # data behind the dataset does (a version, a hash of the files it reads). With the config
    # and len(), it makes the dataset's fingerprint (server/order/fingerprint.py), which servers
    # and clients compare: without it, two servers whose python datasets have the same
    # config and length are taken to serve the same data.
    fingerprint: Callable[[], str] | None = None
    # sample_lengths() -> int64 array [len(dataset)]: each sample's token count, known cheaply
    # at open (jsonl and parquet with `length_column`); called once, by the worker that
    # describes the dataset. Token budgets (`batch_tokens`, server/order/token_batches.py) need it.
    sample_lengths: Callable[[], np.ndarray] | None = None
    # use_prefix_cache(scope): keep what the dataset computes before its first random step
    # (image decodes, a python dataset's `prepare`) in the server's prefix cache, where
    # scope(stage, spec) -> a _prefix_cache.Scope of one stage's entries (`spec`: its config).
    # Given once, after the fingerprint is known (server/sources/prefix_cache.py).
    use_prefix_cache: Callable[[Callable[[str, str], Any]], None] | None = None

    @classmethod
    def of(cls, dataset: Dataset) -> DatasetParts:
        return cls(dataset, **{name: getattr(dataset, name, None) for name in OPTIONAL})

    def read(self, index: int, key: EpochKey) -> dict[str, Any]:
        """Sample `index` as the dataset gives it: `sample(index, key)` where it has that."""
        if self.sample is not None:
            return self.sample(index, key)
        return self.dataset[index]

    @property
    def prefetches(self) -> bool:
        """Whether prefetch() reaches the storage (the front end sends hints only then)."""
        return self.objects_of is not None and self.storage is not None

    def prefetch(self, indices: np.ndarray) -> None:
        """Ask the storage to fetch what these samples read (a hint; it may raise)."""
        if self.prefetches and len(indices):
            assert self.objects_of is not None and self.storage is not None
            self.storage.prefetch(self.objects_of(indices))


# The optional parts' names, in the order above.
OPTIONAL = tuple(f.name for f in fields(DatasetParts) if f.name != "dataset")

