"""What a batch's header may say of its tensors (`check_header`: numeric dtypes, shapes that
give their sizes, aligned offsets, a payload of a size no batch exceeds), and the tensors as
numpy views of the payload once it is here (`numpy_views`).

Threading: receive threads check headers; the views are made where a batch is converted
(receive threads, or batch_at's caller). The dtype cache is functools.lru_cache's (locked).
"""

from __future__ import annotations

import functools

import numpy as np

from stoker.v1 import stoker_pb2 as pb

from .._errors import ProtocolError

# No batch is this large: a header claiming more is corrupt, and is refused before anything
# is allocated for it.
MAX_PAYLOAD_BYTES = 1 << 36
_MAX_DIMS = 32  # numpy's limit is 64; no dataset field comes near
_KINDS = "biufc"  # bool, integers, floats, complex: what a server may send

def check_header(head: pb.BatchFrame) -> None:
    """The header of a batch's first (or only) frame adds up: every tensor a numeric numpy
    dtype whose shape gives its nbytes, at a 64-byte aligned offset after the one before, and
    the last ending at payload_bytes, which is at most MAX_PAYLOAD_BYTES."""
    if not 0 <= head.payload_bytes <= MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"batch {head.batch_index}: payload_bytes {head.payload_bytes} is "
                            f"not in [0, {MAX_PAYLOAD_BYTES}]")
    end = 0
    for t in head.tensors:  # per batch: its messages are made only when one is raised
        dtype = _numeric_dtype(t.dtype)
        if dtype is None:
            raise ProtocolError(f"{_named(head, t)}: dtype {t.dtype[:100]!r} is not a numeric "
                                "numpy dtype")
        shape = t.shape
        if len(shape) > _MAX_DIMS or (shape and min(shape) < 0):
            raise ProtocolError(f"{_named(head, t)}: shape {list(shape)[:_MAX_DIMS + 1]} is "
                                "not a shape")
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d  # Python ints: no overflow
        if nbytes != t.nbytes:
            raise ProtocolError(f"{_named(head, t)}: {t.dtype}{list(shape)} is {nbytes} bytes, "
                                f"the header says {t.nbytes}")
        if t.offset < end or t.offset % 64:
            raise ProtocolError(f"{_named(head, t)}: offset {t.offset} is not 64-byte aligned "
                                f"at or after byte {end}")
        end = t.offset + t.nbytes
    if head.tensors and end != head.payload_bytes:
        raise ProtocolError(f"batch {head.batch_index}: its tensors end at byte {end}, "
                            f"payload_bytes is {head.payload_bytes}")


def _named(head: pb.BatchFrame, t: pb.TensorInfo) -> str:
    """How an error names a tensor of a batch."""
    return f"batch {head.batch_index}: tensor {t.name[:100]!r}"


def _numeric_dtype(name: str) -> np.dtype | None:
    """The little-endian numpy dtype a header names, or None if it is not a plain numeric
    one. Cached: a stream's headers name the same few dtypes batch after batch (names as
    long as no numeric dtype's are not, so a server cannot fill the cache with them)."""
    return _cached_dtype(name) if len(name) <= 16 else _dtype_of(name)


@functools.lru_cache(maxsize=64)
def _cached_dtype(name: str) -> np.dtype | None:
    return _dtype_of(name)


def _dtype_of(name: str) -> np.dtype | None:
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError, SyntaxError):
        return None
    if dtype.kind not in _KINDS or dtype.fields or dtype.subdtype:
        return None
    return dtype.newbyteorder("<")


def numpy_views(payload: np.ndarray, tensors: list[pb.TensorInfo]) -> dict[str, np.ndarray]:
    """Each tensor as a numpy view into the payload (no copy)."""
    out = {}
    for t in tensors:
        dtype = _numeric_dtype(t.dtype)  # checked by check_header as the batch arrived
        assert dtype is not None
        arr = payload[t.offset : t.offset + t.nbytes].view(dtype).reshape(tuple(t.shape))
        out[t.name] = arr
    return out
