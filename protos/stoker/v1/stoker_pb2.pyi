from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class Coordinates(_message.Message):
    __slots__ = ("batch_size", "dataset", "drop_last", "epoch", "rank", "seed", "shuffle", "world_size")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    seed: int
    epoch: int
    shuffle: bool
    rank: int
    world_size: int
    batch_size: int
    drop_last: bool
    def __init__(self, dataset: str | None = ..., seed: int | None = ..., epoch: int | None = ..., shuffle: bool | None = ..., rank: int | None = ..., world_size: int | None = ..., batch_size: int | None = ..., drop_last: bool | None = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("format", "name", "num_samples")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    name: str
    format: str
    num_samples: int
    def __init__(self, name: str | None = ..., format: str | None = ..., num_samples: int | None = ...) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Iterable[DatasetInfo | _Mapping] | None = ...) -> None: ...

class DescribeDatasetRequest(_message.Message):
    __slots__ = ("coordinates",)
    COORDINATES_FIELD_NUMBER: _ClassVar[int]
    coordinates: Coordinates
    def __init__(self, coordinates: Coordinates | _Mapping | None = ...) -> None: ...

class FieldSpec(_message.Message):
    __slots__ = ("dtype", "name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: str | None = ..., dtype: str | None = ..., shape: _Iterable[int] | None = ...) -> None: ...

class DescribeDatasetResponse(_message.Message):
    __slots__ = ("batches_per_epoch", "dataset", "fields", "format", "num_samples", "samples_per_rank")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    format: str
    num_samples: int
    samples_per_rank: int
    batches_per_epoch: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    def __init__(self, dataset: str | None = ..., format: str | None = ..., num_samples: int | None = ..., samples_per_rank: int | None = ..., batches_per_epoch: int | None = ..., fields: _Iterable[FieldSpec | _Mapping] | None = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("batch_indices", "coordinates")
    COORDINATES_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDICES_FIELD_NUMBER: _ClassVar[int]
    coordinates: Coordinates
    batch_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, coordinates: Coordinates | _Mapping | None = ..., batch_indices: _Iterable[int] | None = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("dtype", "name", "nbytes", "offset", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: str | None = ..., dtype: str | None = ..., shape: _Iterable[int] | None = ..., offset: int | None = ..., nbytes: int | None = ...) -> None: ...

class BatchFrame(_message.Message):
    __slots__ = ("batch_index", "data", "epoch", "offset", "payload_bytes", "tensors")
    DATA_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    batch_index: int
    epoch: int
    offset: int
    payload_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    def __init__(self, data: bytes | None = ..., batch_index: int | None = ..., epoch: int | None = ..., offset: int | None = ..., payload_bytes: int | None = ..., tensors: _Iterable[TensorInfo | _Mapping] | None = ...) -> None: ...
