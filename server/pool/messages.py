"""What the worker pool (front end) and a worker process say to each other over their pipe.

Each message is a small frozen dataclass, pickled by the pipe; receivers tell them apart with
`match`. They stay small: a batch's payload travels in shared memory (see pool/batch.py), and a
`Built` carries only its segment's name and layout.

    pool -> worker:  Task | Part | GiveBack | Discard | Stop, or a tuple of them (one pipe
                     write for what one dispatcher round has for a worker, taken in order)
    worker -> pool:  Opened | OpenFailed (once, at start), then Built | BuildFailed per Task,
                     PartBuilt | BuildFailed | Misfit per Part
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from ..order.fingerprint import Fingerprint
from ..order.sampling import EpochKey, Ordering
from .layout import BuiltBatch, TensorLayout


class FailureKind(enum.StrEnum):
    """Why a batch could not be built; the front end maps each to a gRPC status."""

    DATA_LOSS = "data_loss"  # a sample cannot be read or collated
    RESOURCE_EXHAUSTED = "resource_exhausted"  # over the server's max_batch_bytes
    INTERNAL = "internal"  # a bug, a dead worker, a server shutting down
    # Another server may succeed: storage unreachable, this host's /dev/shm full. The client
    # asks another server (or this one again, later).
    UNAVAILABLE = "unavailable"


class BatchFailed(Exception):
    """A batch could not be built: what the pool fails a batch's future with (not a message
    of the pipe: a worker's BuildFailed, a dead worker, a timeout become one). `kind` says why
    (the front end maps it to a gRPC status). The message is what the client is told;
    `detail`, what the server's log says."""

    def __init__(self, kind: FailureKind, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.detail = detail or message


@dataclass(frozen=True)
class DatasetMeta:
    """What worker 0 learns of a dataset when it opens it (DescribeDataset, orderings)."""

    num_samples: int
    fields: list[tuple[str, str, tuple[int, ...]]]
    ordering: Ordering
    # The dataset as the server opened it; every other worker's view is compared with it.
    fingerprint: Fingerprint | None = None
    # Each sample's token count (int64), where the dataset knows it (DatasetParts.lengths):
    # what token budgets (server/order/token_batches.py) plan with.
    lengths: np.ndarray | None = None
    # Its storage takes prefetch hints (DatasetParts.prefetch): tasks carry `ahead` only then.
    prefetches: bool = True


# -- pool -> worker ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    """Build the batch of `indices` of `dataset` for epoch `key`; `ahead`: the samples of a
    later batch, whose objects to prefetch (a hint). `sources`: instead of the samples, a
    batch of one row whose field SOURCES (pool/batch.py) is where each sample comes from."""

    task_id: int
    dataset: str
    indices: np.ndarray
    ahead: np.ndarray
    key: EpochKey
    sources: bool = False

    def __reduce__(self) -> tuple:
        # One per batch through the pipe: the arrays as raw int64 bytes and the key as its
        # fields pickle in a third of the time numpy's own reduction takes (about 11 -> 3 µs
        # here), on the front end's thread that every stream shares.
        k = self.key
        return (_task, (self.task_id, self.dataset, _int64(self.indices), _int64(self.ahead),
                        k.seed, k.epoch, k.shuffle, self.sources))


def _int64(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, "<i8").tobytes()


def _task(task_id: int, dataset: str, indices: bytes, ahead: bytes, seed: int, epoch: int,
          shuffle: bool, sources: bool = False) -> Task:
    """A Task as its __reduce__ sent it (the arrays writable, as pickled ones are)."""
    return Task(task_id, dataset, np.frombuffer(indices, "<i8").copy(),
                np.frombuffer(ahead, "<i8").copy(), EpochKey(seed, epoch, shuffle), sources)


@dataclass(frozen=True)
class Part:
    """Build rows [first, first + len(indices)) of a batch, whose layout the pool planned,
    into the pool's segment `segment` (at least `size` bytes): the samples `indices` for epoch
    `key`, each sample's delivered index into the sample_index rows. `ahead`: this part's
    share of a later batch's samples, to prefetch (a hint). Writing the same rows again
    writes the same bytes: a part whose worker died is sent to another."""

    task_id: int
    dataset: str
    segment: str
    size: int
    layout: tuple[TensorLayout, ...]
    first: int
    indices: np.ndarray
    ahead: np.ndarray
    key: EpochKey


@dataclass(frozen=True)
class GiveBack:
    """The front end has sent these batches: the worker may write new ones into them."""

    segments: list[str]


@dataclass(frozen=True)
class Discard:
    """A client may still read these batches: the worker forgets them, never writes them."""

    segments: list[str]


@dataclass(frozen=True)
class Stop:
    """Exit now (the pool is closing)."""


# -- worker -> pool ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Opened:
    """Every dataset opened; `meta` per dataset from the worker asked to probe, else None;
    `fingerprints`: every dataset as this worker sees it (every worker sends them)."""

    meta: dict[str, DatasetMeta] | None
    fingerprints: dict[str, Fingerprint] = field(default_factory=dict)


@dataclass(frozen=True)
class OpenFailed:
    """A dataset did not open; the worker exits. `message` names it and says why."""

    message: str


@dataclass(frozen=True)
class Built:
    task_id: int
    batch: BuiltBatch  # lent to the front end, which gives its segment back


@dataclass(frozen=True)
class BuildFailed:
    task_id: int
    kind: FailureKind
    message: str  # what the client is told (with the user's traceback, if any)
    detail: str = ""  # what the server's log says instead: the full text ("": `message`)


@dataclass(frozen=True)
class PartBuilt:
    """A Part's rows are written. `skipped`: samples replaced under on_error: skip;
    `seconds`: the worker's time on it."""

    task_id: int
    skipped: int
    seconds: float


@dataclass(frozen=True)
class Misfit:
    """A Part met what the planned layout cannot hold (a sample with other fields, dtypes or
    shapes), or files changed since the listing: the batch is built whole by one worker,
    which gives the bytes, or the error, that a one-worker build gives."""

    task_id: int


ToWorker = Task | Part | GiveBack | Discard | Stop
FromWorker = Opened | OpenFailed | Built | BuildFailed | PartBuilt | Misfit
