"""What a batch stream sees of the front end: a `SessionContext`, made once by the
DataService (server/front/service.py) and handed to every StreamSession
(server/front/session.py), which reads nothing else of the service.

Threading contract: the fields are shared by every stream and read on the server's one
asyncio loop; the callables are called there too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stoker.v1 import stoker_pb2 as pb

    from .._config import ServerSettings
    from ..order.sampling import Coordinates
    from ..pool.shm import ReadMappings
    from ..pool.workers import DatasetMeta
    from .data_listener import DataSockets
    from .grants import Grant
    from .limits import Admission
    from .metrics import Metrics
    from .shared_batches import SharedBatches


@dataclass(frozen=True)
class SessionContext:
    """The front end's parts a stream reads and calls."""

    settings: ServerSettings  # max_credits, frame_bytes, shared_memory
    metrics: Metrics
    # Built batches, shared by the streams that ask for the same ones; a stream's batches
    # come from here and go back here.
    shared: SharedBatches
    admission: Admission  # open calls and held shared memory, per client
    mappings: ReadMappings  # of the workers' segments, kept between batches
    data_sockets: DataSockets | None  # None: no data socket is offered
    # Checked coordinates (of a dataset the caller's grant may read) and their dataset's
    # meta; raises refusal.Abort naming the field.
    coordinates: Callable[[pb.Coordinates, Grant], tuple[Coordinates, DatasetMeta]]
    # Batches ahead of the one asked for whose samples the workers prefetch (it follows the
    # pool's depth, so it is asked for each credit).
    lookahead: Callable[[], int]
    # Whether the server is draining: credits are then answered UNAVAILABLE, in-band.
    draining: Callable[[], bool]
