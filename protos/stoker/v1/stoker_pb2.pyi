from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Coordinates(_message.Message):
    __slots__ = ("dataset", "seed", "epoch", "shuffle", "rank", "world_size", "batch_size", "drop_last", "fingerprint", "start", "batch_tokens", "token_cost", "excluded", "excluded_digest", "order", "snapshot")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COST_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    seed: int
    epoch: int
    shuffle: bool
    rank: int
    world_size: int
    batch_size: int
    drop_last: bool
    fingerprint: str
    start: int
    batch_tokens: int
    token_cost: str
    excluded: _containers.RepeatedScalarFieldContainer[int]
    excluded_digest: str
    order: int
    snapshot: str
    def __init__(self, dataset: _Optional[str] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., shuffle: _Optional[bool] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., batch_size: _Optional[int] = ..., drop_last: _Optional[bool] = ..., fingerprint: _Optional[str] = ..., start: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., token_cost: _Optional[str] = ..., excluded: _Optional[_Iterable[int]] = ..., excluded_digest: _Optional[str] = ..., order: _Optional[int] = ..., snapshot: _Optional[str] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("digest", "objects", "bytes", "orders", "snapshot")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ORDERS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    digest: str
    objects: int
    bytes: int
    orders: _containers.RepeatedScalarFieldContainer[int]
    snapshot: str
    def __init__(self, digest: _Optional[str] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., orders: _Optional[_Iterable[int]] = ..., snapshot: _Optional[str] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("name", "format", "num_samples", "fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    format: str
    num_samples: int
    fingerprint: Fingerprint
    def __init__(self, name: _Optional[str] = ..., format: _Optional[str] = ..., num_samples: _Optional[int] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ...) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class DescribeDatasetRequest(_message.Message):
    __slots__ = ("coordinates", "locate", "consumed")
    COORDINATES_FIELD_NUMBER: _ClassVar[int]
    LOCATE_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    coordinates: Coordinates
    locate: Locate
    consumed: Consumed
    def __init__(self, coordinates: _Optional[_Union[Coordinates, _Mapping]] = ..., locate: _Optional[_Union[Locate, _Mapping]] = ..., consumed: _Optional[_Union[Consumed, _Mapping]] = ...) -> None: ...

class Consumed(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    def __init__(self, steps: _Optional[int] = ...) -> None: ...

class Locate(_message.Message):
    __slots__ = ("step", "world_sizes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZES_FIELD_NUMBER: _ClassVar[int]
    step: int
    world_sizes: _containers.RepeatedCompositeFieldContainer[WorldSizeFrom]
    def __init__(self, step: _Optional[int] = ..., world_sizes: _Optional[_Iterable[_Union[WorldSizeFrom, _Mapping]]] = ...) -> None: ...

class WorldSizeFrom(_message.Message):
    __slots__ = ("from_step", "world_size")
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    from_step: int
    world_size: int
    def __init__(self, from_step: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class Located(_message.Message):
    __slots__ = ("epoch", "batch_index", "start")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    batch_index: int
    start: int
    def __init__(self, epoch: _Optional[int] = ..., batch_index: _Optional[int] = ..., start: _Optional[int] = ...) -> None: ...

class FieldSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DescribeDatasetResponse(_message.Message):
    __slots__ = ("dataset", "format", "num_samples", "samples_per_rank", "batches_per_epoch", "fields", "fingerprint", "max_credits", "capacity", "located", "consumed")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CREDITS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LOCATED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    format: str
    num_samples: int
    samples_per_rank: int
    batches_per_epoch: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    fingerprint: Fingerprint
    max_credits: int
    capacity: Capacity
    located: Located
    consumed: int
    def __init__(self, dataset: _Optional[str] = ..., format: _Optional[str] = ..., num_samples: _Optional[int] = ..., samples_per_rank: _Optional[int] = ..., batches_per_epoch: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., max_credits: _Optional[int] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ..., located: _Optional[_Union[Located, _Mapping]] = ..., consumed: _Optional[int] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("workers", "samples_per_second")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    workers: int
    samples_per_second: float
    def __init__(self, workers: _Optional[int] = ..., samples_per_second: _Optional[float] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("coordinates", "batch_indices", "shm_probe", "released", "report", "compression", "data_socket", "data_socket_unreachable")
    COORDINATES_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDICES_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    coordinates: Coordinates
    batch_indices: _containers.RepeatedScalarFieldContainer[int]
    shm_probe: SharedMemoryProbe
    released: _containers.RepeatedScalarFieldContainer[str]
    report: ClientReport
    compression: str
    data_socket: bool
    data_socket_unreachable: bool
    def __init__(self, coordinates: _Optional[_Union[Coordinates, _Mapping]] = ..., batch_indices: _Optional[_Iterable[int]] = ..., shm_probe: _Optional[_Union[SharedMemoryProbe, _Mapping]] = ..., released: _Optional[_Iterable[str]] = ..., report: _Optional[_Union[ClientReport, _Mapping]] = ..., compression: _Optional[str] = ..., data_socket: _Optional[bool] = ..., data_socket_unreachable: _Optional[bool] = ...) -> None: ...

class DataSocket(_message.Message):
    __slots__ = ("port", "token", "proof", "credits")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    port: int
    token: bytes
    proof: bool
    credits: bool
    def __init__(self, port: _Optional[int] = ..., token: _Optional[bytes] = ..., proof: _Optional[bool] = ..., credits: _Optional[bool] = ...) -> None: ...

class ClientReport(_message.Message):
    __slots__ = ("wait_seconds", "loop_seconds", "window", "window_why", "budget_batches")
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    WINDOW_WHY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BATCHES_FIELD_NUMBER: _ClassVar[int]
    wait_seconds: float
    loop_seconds: float
    window: int
    window_why: str
    budget_batches: int
    def __init__(self, wait_seconds: _Optional[float] = ..., loop_seconds: _Optional[float] = ..., window: _Optional[int] = ..., window_why: _Optional[str] = ..., budget_batches: _Optional[int] = ...) -> None: ...

class SharedMemoryProbe(_message.Message):
    __slots__ = ("name", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: bytes
    def __init__(self, name: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
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
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class BatchFrame(_message.Message):
    __slots__ = ("batch_index", "epoch", "offset", "payload_bytes", "tensors", "compression", "data", "error", "shm_name", "data_socket", "via_socket")
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    VIA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    epoch: int
    offset: int
    payload_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    compression: str
    data: bytes
    error: BatchError
    shm_name: str
    data_socket: DataSocket
    via_socket: bool
    def __init__(self, batch_index: _Optional[int] = ..., epoch: _Optional[int] = ..., offset: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., compression: _Optional[str] = ..., data: _Optional[bytes] = ..., error: _Optional[_Union[BatchError, _Mapping]] = ..., shm_name: _Optional[str] = ..., data_socket: _Optional[_Union[DataSocket, _Mapping]] = ..., via_socket: _Optional[bool] = ...) -> None: ...

class BatchError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ProvenanceRequest(_message.Message):
    __slots__ = ("coordinates", "batch_index")
    COORDINATES_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    coordinates: Coordinates
    batch_index: int
    def __init__(self, coordinates: _Optional[_Union[Coordinates, _Mapping]] = ..., batch_index: _Optional[int] = ...) -> None: ...

class SampleSource(_message.Message):
    __slots__ = ("sample_index", "source", "file", "offset", "nbytes", "line", "row_group", "row", "member", "component", "component_index")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    ROW_GROUP_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    source: str
    file: str
    offset: int
    nbytes: int
    line: int
    row_group: int
    row: int
    member: str
    component: str
    component_index: int
    def __init__(self, sample_index: _Optional[int] = ..., source: _Optional[str] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., line: _Optional[int] = ..., row_group: _Optional[int] = ..., row: _Optional[int] = ..., member: _Optional[str] = ..., component: _Optional[str] = ..., component_index: _Optional[int] = ...) -> None: ...

class ProvenanceResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[SampleSource]
    def __init__(self, samples: _Optional[_Iterable[_Union[SampleSource, _Mapping]]] = ...) -> None: ...
