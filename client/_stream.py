"""One StreamBatches call to one server: credits go out, whole batches come back.

Threading: credit() and close() may be called from any thread (the request queue is
thread-safe). One receive thread per stream reads frames, assembles batches, finishes them
(views, or the device copy) and reports each through on_batch; when the call ends it reports
once through on_end, with the error, or None after close().
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from stoker.v1 import stoker_pb2 as pb

from ._errors import RemoteError
from ._frames import Assembled, Assembler

METHOD = "/stoker.v1.DataService/StreamBatches"
_STATUS = {code.value[0]: code for code in grpc.StatusCode}

# on_batch(stream, batch_index, finished batch | RemoteError for that batch)
OnBatch = Callable[["BatchStream", int, Any], None]
# on_end(stream, RemoteError | None)
OnEnd = Callable[["BatchStream", "RemoteError | None"], None]
# A stream's maker (BatchStream itself, or a test's fake): (channel, address, spec, on_batch,
# on_end) -> a started stream with address, bytes_received, credit, report and close.
StreamFactory = Callable[[grpc.Channel, str, "StreamSpec", OnBatch, OnEnd], "BatchStream"]


@dataclass(frozen=True)
class StreamSpec:
    """What every stream of one pass over an epoch asks for, and what it does with a batch."""

    coordinates: pb.Coordinates
    allocate: Callable[[int], tuple[Any, Any]]  # nbytes -> (buffer, a numpy view of it)
    finish: Callable[[Assembled], Any]  # an assembled batch -> what the loop is given
    shm_probe: pb.SharedMemoryProbe | None = None  # None: no shared memory
    compression: str = ""  # "" or "zstd"
    data_socket: bool = False

    def opening(self) -> pb.StreamRequest:
        """The stream's first request."""
        return pb.StreamRequest(coordinates=self.coordinates, shm_probe=self.shm_probe,
                                compression=self.compression, data_socket=self.data_socket)


class BatchStream:
    def __init__(self, channel: grpc.Channel, address: str, spec: StreamSpec,
                 on_batch: OnBatch, on_end: OnEnd) -> None:
        self.address = address
        self._requests: queue.SimpleQueue[pb.StreamRequest | None] = queue.SimpleQueue()
        self._requests.put(spec.opening())
        # No response deserializer: frames arrive as bytes and are split without a parse copy.
        method = channel.stream_stream(
            METHOD, request_serializer=pb.StreamRequest.SerializeToString)
        self._call = method(self._outgoing())
        self._assembler = Assembler(spec.allocate, self._release)
        self._assembler.host = address.rpartition(":")[0].strip("[]")
        self._finish = spec.finish
        self._on_batch = on_batch
        self._on_end = on_end
        self._closed = False
        self.bytes_received = 0
        self._thread = threading.Thread(target=self._receive, name="stoker-receive", daemon=True)
        self._thread.start()

    def credit(self, batch_indices: Iterable[int]) -> None:
        """Ask for these batches (each is answered once)."""
        indices = list(batch_indices)
        if indices:
            self._requests.put(pb.StreamRequest(batch_indices=indices))

    def report(self, wait_seconds: float, loop_seconds: float) -> None:
        """Tell the server how the training loop is doing (its data stall metric)."""
        self._requests.put(pb.StreamRequest(report=pb.ClientReport(
            wait_seconds=wait_seconds, loop_seconds=loop_seconds)))

    def _release(self, shm_name: str) -> None:
        self._requests.put(pb.StreamRequest(released=[shm_name]))

    def close(self, wait: bool = True) -> None:
        """Cancel the call (the server frees what it held for it) and stop receiving."""
        self._closed = True
        self._requests.put(None)
        self._call.cancel()
        self._assembler.close()  # a receive blocked on the data socket returns
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _outgoing(self) -> Iterator[pb.StreamRequest]:
        while (req := self._requests.get()) is not None:
            yield req

    def _receive(self) -> None:
        error: RemoteError | None = None
        try:
            for raw in self._call:
                self.bytes_received += len(raw)
                done = self._assembler.feed(raw)
                if isinstance(done, Assembled) and done.shared:
                    self.bytes_received += done.payload_bytes  # read from shared memory
                if isinstance(done, pb.BatchFrame):  # this batch failed; the stream goes on
                    code = _STATUS.get(done.error.code, grpc.StatusCode.UNKNOWN)
                    self._on_batch(self, done.batch_index,
                                   RemoteError(code, done.error.message, self.address))
                elif done is not None:
                    try:
                        item = self._finish(done)
                    except Exception as e:
                        item = RemoteError(grpc.StatusCode.INTERNAL,
                                           f"batch {done.batch_index} cannot be converted here: "
                                           f"{type(e).__name__}: {e}", self.address)
                    self._on_batch(self, done.batch_index, item)
            if not self._closed:
                error = RemoteError(grpc.StatusCode.UNAVAILABLE, "the server ended the stream",
                                    self.address)
        except grpc.RpcError as e:
            if not self._closed:
                error = RemoteError.from_rpc(e, self.address)
        except Exception as e:  # a malformed frame: nothing after it can be trusted
            error = RemoteError(grpc.StatusCode.INTERNAL, f"bad frame: {e}", self.address)
            # The call itself is still open: end it, or the server keeps the stream (and
            # this process a thread feeding it requests) until the channel closes.
            self._requests.put(None)
            self._call.cancel()
        self._assembler.close()
        self._on_end(self, None if self._closed else error)
