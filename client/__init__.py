"""stoker.client: the training side. Needs grpcio, protobuf and numpy; torch for torch output.

    from stoker.client import RemoteLoader

    with RemoteLoader("dataserver:50051", dataset="faces", batch_size=64) as loader:
        for batch in loader:
            ...
"""

from ._errors import DataMismatch, ProtocolError, RemoteError
from ._loader import RemoteLoader
from .delivery.buffers import BufferPool

__all__ = ["BufferPool", "DataMismatch", "ProtocolError", "RemoteError", "RemoteLoader"]
