"""One StreamBatches call to one server: credits go out, whole batches come back.

Batches come on the stream's data connection when the server offers one and it can be
reached (records: client/transport/frames.py, Assembler.receive), else in gRPC frames.

Threading: credit() and close() may be called from any thread (the request queue is
thread-safe). One receive thread per stream reads the gRPC frames; once a data connection is
up, a second one reads its records. Whichever holds a batch assembles it, finishes it (views,
or the device copy) and reports it through on_batch; when the call ends, the gRPC thread
reports once through on_end (after the data thread has stopped), with the error, or None
after close().
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from stoker.v1 import stoker_pb2 as pb
from stoker.v1.wire import capacity_of, encode_credits

from .._errors import ConnectionCut, ProtocolError, RemoteError
from .datalink import CONNECT_BUDGET, DataLink, Transports
from .frames import Assembled, Assembler

METHOD = "/stoker.v1.DataService/StreamBatches"
# Seconds the data thread, its connection broken, waits for the call to end by itself (the
# server gone: its status then says why) before ending it.
CALL_GRACE = 1.0
# Seconds the call's end waits for the data connection's records already sent (a drain).
DRAIN_WAIT = 10.0
_STATUS = {code.value[0]: code for code in grpc.StatusCode}

# on_batch(stream, batch_index, finished batch | RemoteError for that batch)
OnBatch = Callable[["BatchStream", int, Any], None]
# on_end(stream, RemoteError | None)
OnEnd = Callable[["BatchStream", "RemoteError | None"], None]


class Stream(Protocol):
    """What the fleet uses of a stream: BatchStream, or a test's fake (a type checker holds
    the fakes to it)."""

    address: str
    capacity: tuple[int, float] | None

    @property
    def bytes_received(self) -> int: ...
    def credit(self, batch_indices: Iterable[int]) -> None: ...
    def report(self, wait_seconds: float, loop_seconds: float,
               window: tuple[int, str, int] = (0, "", 0)) -> None: ...
    def close(self, wait: bool = True) -> None: ...


# A stream's maker (BatchStream itself, or a test's fake): (channel, address, spec, on_batch,
# on_end) -> a started stream.
StreamFactory = Callable[[grpc.Channel, str, "StreamSpec", OnBatch, OnEnd], Stream]


@dataclass(frozen=True)
class StreamSpec:
    """What every stream of one pass over an epoch asks for, and what it does with a batch."""

    coordinates: pb.Coordinates
    allocate: Callable[[int], tuple[Any, Any]]  # nbytes -> (buffer, a numpy view of it)
    finish: Callable[[Assembled], Any]  # an assembled batch -> what the loop is given
    shm_probe: pb.SharedMemoryProbe | None = None  # None: no shared memory
    compression: str = ""  # "" or "zstd"
    data_socket: bool = True  # ask for a data connection: on one host too it wins over shm
    link: DataLink = field(default_factory=DataLink)  # how to connect and claim one
    transports: Transports | None = None  # where each stream notes the path it got
    # (epoch, batch index) -> the batch of 0 rows a server answers OUT_OF_RANGE for (all its
    # samples excluded: server/front/credits.py); None: such an answer is an error.
    empty: Callable[[int, int], Assembled] | None = None

    def opening(self) -> pb.StreamRequest:
        """The stream's first request."""
        return pb.StreamRequest(coordinates=self.coordinates, shm_probe=self.shm_probe,
                                compression=self.compression, data_socket=self.data_socket)


class BatchStream:
    def __init__(self, channel: grpc.Channel, address: str, spec: StreamSpec,
                 on_batch: OnBatch, on_end: OnEnd) -> None:
        self.address = address
        self._spec = spec
        self._requests: queue.SimpleQueue[pb.StreamRequest | None] = queue.SimpleQueue()
        self._requests.put(spec.opening())
        # No response deserializer: frames arrive as bytes and are split without a parse copy.
        method = channel.stream_stream(
            METHOD, request_serializer=pb.StreamRequest.SerializeToString)
        self._call = method(self._outgoing())
        self._assembler = Assembler(spec.allocate, self._release)
        self._host = address.rpartition(":")[0].strip("[]")
        self._finish = spec.finish
        self._on_batch = on_batch
        self._on_end = on_end
        self._closed = False
        self._framed = self._socket_bytes = 0
        self._noted = False  # the path this stream's batches take, told to spec.transports
        self._data: threading.Thread | None = None  # reads the data connection
        self._data_error: RemoteError | None = None  # why the data connection broke
        # The data connection, once up, where the server reads credits on it (plain TCP):
        # credits go there, a few bytes from the caller's thread, not in a gRPC message.
        self._credit_sock: socket.socket | None = None
        self._credit_lock = threading.Lock()  # one record at a time
        self._ended_for_data = False  # the call was cancelled because it broke
        self._call_over = threading.Event()
        # What the server said it can do (workers, samples/s), from the stream's metadata.
        self.capacity: tuple[int, float] | None = None
        self._thread = threading.Thread(target=self._receive, name="stoker-receive", daemon=True)
        self._thread.start()

    @property
    def bytes_received(self) -> int:
        """Bytes of frames and records received (payloads read from shared memory too)."""
        return self._framed + self._socket_bytes

    def credit(self, batch_indices: Iterable[int]) -> None:
        """Ask for these batches (each is answered once)."""
        indices = list(batch_indices)
        if not indices:
            return
        sock = self._credit_sock
        if sock is not None:
            record = encode_credits(indices)
            try:
                with self._credit_lock:
                    sock.sendall(record)
                return
            except OSError:  # the connection broke (its reader says so): gRPC takes it
                self._credit_sock = None
        self._requests.put(pb.StreamRequest(batch_indices=indices))

    def report(self, wait_seconds: float, loop_seconds: float,
               window: tuple[int, str, int] = (0, "", 0)) -> None:
        """Tell the server how the training loop is doing (its data stall metric), and the
        client's `window` (batches in flight, why, the most its memory budget holds)."""
        self._requests.put(pb.StreamRequest(report=pb.ClientReport(
            wait_seconds=wait_seconds, loop_seconds=loop_seconds, window=window[0],
            window_why=window[1], budget_batches=window[2])))

    def _release(self, shm_name: str) -> None:
        self._requests.put(pb.StreamRequest(released=[shm_name]))

    def close(self, wait: bool = True) -> None:
        """Cancel the call (the server frees what it held for it) and stop receiving."""
        self._closed = True
        self._requests.put(None)
        self._call.cancel()
        self._assembler.close()  # a receive blocked on the data connection returns
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _outgoing(self) -> Iterator[pb.StreamRequest]:
        """The requests; credits and releases queued one behind another go as one message
        (none waits for another: releases held for a credit cost the servers new segments)."""
        nxt: Any = self._requests.get()
        while nxt is not None:
            req, nxt = nxt, _NOTHING
            while _mergeable(req):
                try:
                    more = self._requests.get_nowait()
                except queue.Empty:
                    break
                if more is None or not _mergeable(more):
                    nxt = more
                    break
                req.MergeFrom(more)  # repeated fields: appended, in order
            yield req
            if nxt is _NOTHING:
                nxt = self._requests.get()

    def _note(self, transport: str, why: str, warn: bool = False) -> None:
        if self._spec.transports is not None and not (self._noted and not warn):
            self._noted = True
            self._spec.transports.note(self.address, transport, why, warn)

    def _connect(self, offer: pb.DataSocket) -> None:
        """Connect to the offered data connection and start reading it; if that cannot be
        done within CONNECT_BUDGET s, tell the server (it answers in frames at once)."""
        link = self._spec.link
        try:
            sock = link.connect(self._host, offer, CONNECT_BUDGET)
        except (OSError, ValueError) as e:
            self._requests.put(pb.StreamRequest(data_socket_unreachable=True))
            self._note("frames", f"the data port {self._host}:{offer.port} cannot be reached "
                       f"within {CONNECT_BUDGET:g} s ({type(e).__name__}: {e})", warn=True)
            return
        self._assembler.sock = sock
        if self._closed:
            self._assembler.close()
            return
        self._note("data_socket", "TLS" if link.tls is not None else "plain TCP")
        if offer.credits and link.tls is None:
            self._credit_sock = sock
        self._data = threading.Thread(target=self._read_data, args=(sock,),
                                      name="stoker-receive-data", daemon=True)
        self._data.start()

    def _deliver(self, done: Assembled | pb.BatchFrame) -> None:
        """Report a batch (or its error) through on_batch."""
        if isinstance(done, pb.BatchFrame):  # this batch failed; the stream goes on
            code = _STATUS.get(done.error.code, grpc.StatusCode.UNKNOWN)
            if code != grpc.StatusCode.OUT_OF_RANGE or self._spec.empty is None:
                self._on_batch(self, done.batch_index,
                               RemoteError(code, done.error.message, self.address))
                return
            done = self._spec.empty(done.epoch, done.batch_index)
        try:
            item = self._finish(done)
        except Exception as e:
            item = RemoteError(grpc.StatusCode.INTERNAL,
                               f"batch {done.batch_index} cannot be converted here: "
                               f"{type(e).__name__}: {e}", self.address)
        self._on_batch(self, done.batch_index, item)

    def _read_data(self, sock: socket.socket) -> None:
        """The data thread: every record until the connection ends."""
        assembler = self._assembler
        try:
            while (done := assembler.receive(sock)) is not None:
                self._socket_bytes += assembler.record_bytes
                self._deliver(done)
            raise ConnectionError("the server closed the data connection")
        except Exception as e:
            if self._closed:
                return
            # A record cut short is the connection breaking, not the server breaking the rules.
            bad = isinstance(e, ProtocolError) and not isinstance(e, ConnectionCut)
            self._data_error = RemoteError(
                grpc.StatusCode.INTERNAL if bad else grpc.StatusCode.UNAVAILABLE,
                f"{'bad record' if bad else 'data connection broken'}: {e}", self.address)
        # A server that went away ends the call too, its status saying why: wait for that a
        # moment; else only this connection broke, and the stream can deliver nothing more.
        if not self._call_over.wait(0 if bad else CALL_GRACE):
            self._ended_for_data = True
            self._requests.put(None)
            self._call.cancel()

    def _receive(self) -> None:
        error: RemoteError | None = None
        try:
            for raw in self._call:
                if self.capacity is None:  # its metadata came before this first frame
                    self.capacity = capacity_of(self._call.initial_metadata())
                self._framed += len(raw)
                done = self._assembler.feed(raw)
                if isinstance(done, pb.DataSocket):
                    self._connect(done)
                    continue
                if done is None:
                    continue
                if isinstance(done, Assembled):
                    if done.shared:
                        self._framed += done.payload_bytes  # read from shared memory
                        self._note("shm", "same host")
                    else:
                        self._note("frames", "asked for" if not self._spec.data_socket
                                   else "the server offered no data connection")
                self._deliver(done)
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
        self._call_over.set()
        data = self._data
        if data is not None and not self._closed:
            data.join(DRAIN_WAIT)  # records sent before the call ended still count
        self._assembler.close()
        if data is not None:
            data.join(timeout=10)
        if self._data_error is not None and (self._ended_for_data or error is None):
            error = self._data_error
        self._on_end(self, None if self._closed else error)


_NOTHING = object()


def _mergeable(req: pb.StreamRequest) -> bool:
    """Credits or releases and nothing else: such messages can go as one."""
    return bool(fields := {f.name for f, _ in req.ListFields()}) and fields <= _MERGEABLE


_MERGEABLE = frozenset({"batch_indices", "released"})
