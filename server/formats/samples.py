"""What a dataset's sample is once read: a dict of numeric numpy arrays, some marked `Padded`.

The contract between the formats and what collates their samples (pool/batch.py), and the
read that mixtures (formats/mixture.py) make of their components: a leaf beside
_contract.py, so that neither imports how a batch is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..order.sampling import FIRST_EPOCH, EpochKey
from ..sources import StorageUnavailable

if TYPE_CHECKING:
    from ._contract import DatasetParts


class SampleError(Exception):
    """A sample could not be read or collated; the message names the sample and the cause."""



class Padded(np.ndarray):
    """A sample's field whose `pad_axes` may differ in size between the samples of a batch:
    collated zero-padded at the end of each such axis to the batch's largest. Make one with
    `padded()`; any format may return it (numeric dtypes only, like every field)."""

    pad_axes: tuple[int, ...] = ()

    def __array_finalize__(self, obj: Any) -> None:
        self.pad_axes = getattr(obj, "pad_axes", ())


def padded(array: np.ndarray, axes: tuple[int, ...]) -> Padded:
    """`array` (not copied) marked as padded along `axes` when collated."""
    out = np.asarray(array).view(Padded)
    out.pad_axes = tuple(sorted(a % out.ndim for a in axes))
    return out


def _as_array(value: Any) -> np.ndarray:
    if type(value) is np.ndarray:  # the common case first (Padded is a subclass)
        if value.dtype.kind not in "biuf":
            raise TypeError(f"dtype {value.dtype} is not a number type")
        return value
    if isinstance(value, Padded):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"dtype {value.dtype} is not a number type")
        return value
    if isinstance(value, bool):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, int):
        return np.asarray(value, dtype=np.int64)
    if isinstance(value, float):
        return np.asarray(value, dtype=np.float64)
    if isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"dtype {arr.dtype} is not a number type")
        return arr
    raise TypeError(f"{type(value).__name__} is not a numpy array or number")


# on_error: skip tries at most this many replacements for one bad sample.


def _place(dataset: DatasetParts, i: int, error: Exception) -> str:
    """" (where sample i comes from)", unless the error names it already: said once."""
    place = dataset.source_of(i) if dataset.source_of else ""
    return f" ({place})" if place and place not in str(error) else ""


def fetch_sample(dataset: DatasetParts, i: int, key: EpochKey = FIRST_EPOCH
                 ) -> dict[str, np.ndarray]:
    """Sample i as a dict of numpy arrays. A dataset with `sample(i, key)` gets the epoch's
    key (augmentation, packing); a plain map-style one is indexed. Raises SampleError, or
    StorageUnavailable, which on_error: skip does not skip (the sample is not bad)."""
    try:
        raw = dataset.read(i, key)
    except StorageUnavailable as e:  # not this sample's fault: no skipping, ask elsewhere
        raise StorageUnavailable(f"sample {i}{_place(dataset, i, e)}: {e}") from e
    except Exception as e:  # the user's code: any failure is this sample's failure
        raise SampleError(f"sample {i}{_place(dataset, i, e)}: {type(e).__name__}: {e}") from e
    if not isinstance(raw, dict):
        raise SampleError(f"sample {i}: expected a dict of fields, got {type(raw).__name__}")
    try:
        return {str(k): _as_array(v) for k, v in raw.items()}
    except (TypeError, OverflowError) as e:  # OverflowError: an int beyond int64
        raise SampleError(f"sample {i}: {e}") from None
