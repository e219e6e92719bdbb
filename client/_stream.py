"""One StreamBatches call to one server: credits go out, whole batches come back.

Threading: credit(), take() and close() are called from the consumer's thread; one receive
thread reads frames, assembles batches and finishes them (views, or the device copy).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from stoker.v1 import stoker_pb2 as pb

from ._errors import RemoteError
from ._frames import Assembled, Assembler

METHOD = "/stoker.v1.DataService/StreamBatches"
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


class BatchStream:
    def __init__(self, channel: grpc.Channel, address: str, coordinates: pb.Coordinates,
                 allocate: Callable[[int], tuple[Any, Any]],
                 finish: Callable[[Assembled], Any]) -> None:
        self.address = address
        self._requests: queue.SimpleQueue[pb.StreamRequest | None] = queue.SimpleQueue()
        self._requests.put(pb.StreamRequest(coordinates=coordinates))
        # No response deserializer: frames arrive as bytes and are split without a parse copy.
        method = channel.stream_stream(
            METHOD, request_serializer=pb.StreamRequest.SerializeToString)
        self._call = method(self._outgoing())
        self._assembler = Assembler(allocate)
        self._finish = finish
        self._ready: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._ended = False
        self._closed = False
        self.bytes_received = 0
        self._thread = threading.Thread(target=self._receive, name="stoker-receive", daemon=True)
        self._thread.start()

    def credit(self, batch_indices: Iterable[int]) -> None:
        """Ask for these batches (each is answered once)."""
        indices = list(batch_indices)
        if indices:
            self._requests.put(pb.StreamRequest(batch_indices=indices))

    def take(self, batch_index: int, timeout: float) -> Any:
        """The finished batch `batch_index`, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while batch_index not in self._ready:
                if self._error is not None:
                    raise self._error
                if self._ended:
                    raise RemoteError(grpc.StatusCode.UNAVAILABLE,
                                      f"stream ended before batch {batch_index}", self.address)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RemoteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"no batch {batch_index} within {timeout:g}s", self.address)
                self._cond.wait(remaining)
            item = self._ready.pop(batch_index)
        if isinstance(item, RemoteError):
            raise item
        return item

    def close(self) -> None:
        """Cancel the call (the server frees what it held for it) and stop receiving."""
        self._closed = True
        self._requests.put(None)
        self._call.cancel()
        self._thread.join(timeout=10)

    def _outgoing(self) -> Iterator[pb.StreamRequest]:
        while (req := self._requests.get()) is not None:
            yield req

    def _receive(self) -> None:
        error: BaseException | None = None
        try:
            for raw in self._call:
                self.bytes_received += len(raw)
                done = self._assembler.feed(raw)
                if isinstance(done, pb.BatchFrame):  # this batch failed; the stream goes on
                    code = _STATUS.get(done.error.code, grpc.StatusCode.UNKNOWN)
                    item: Any = RemoteError(code, done.error.message, self.address)
                elif done is not None:
                    try:
                        item = self._finish(done)
                    except Exception as e:
                        item = RemoteError(grpc.StatusCode.INTERNAL,
                                           f"batch {done.batch_index} cannot be converted here: "
                                           f"{type(e).__name__}: {e}", self.address)
                if done is not None:
                    with self._cond:
                        self._ready[done.batch_index] = item
                        self._cond.notify_all()
        except grpc.RpcError as e:
            if not self._closed:
                error = RemoteError.from_rpc(e, self.address)
        except Exception as e:  # a malformed frame: nothing after it can be trusted
            error = RemoteError(grpc.StatusCode.INTERNAL, f"bad frame: {e}", self.address)
        with self._cond:
            self._error = error
            self._ended = True
            self._cond.notify_all()
