"""One batch on demand, beside the loop: `fetch_one` opens a short stream of its own;
`ask_sources`, where a batch's samples come from (one Provenance call).

A batch is a pure function of its coordinates, so any batch of any epoch can be asked for
alone: one stream, one credit, one answer. The stream is not the loop's (the scheduler's
servers hold the loop's streams and credits; this one is opened on their channels and closed
at once), so an iteration in progress is not disturbed.

Threading: fetch_one runs on the caller's thread and waits on an Event that the stream's
receive thread sets.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import stoker_pb2_grpc as pb_grpc

from ._errors import RemoteError
from .fleet.scheduler import FATAL
from .transport.stream import BatchStream

if TYPE_CHECKING:
    from .fleet.servers import Server, ServerSet
    from .transport.stream import StreamSpec


T = TypeVar("T")


class _Answer:
    """What one stream said of the batch: set once, by its receive thread."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.item: Any = None
        self.ended: RemoteError | None = None
        self.done = threading.Event()

    def on_batch(self, stream: BatchStream, index: int, item: Any) -> None:
        if index == self.index and self.item is None:
            self.item = item
            self.done.set()

    def on_end(self, stream: BatchStream, error: RemoteError | None) -> None:
        self.ended = error
        self.done.set()


def fetch_one(servers: ServerSet, spec: StreamSpec, index: int, timeout: float) -> Any:
    """Batch `index` of `spec`'s coordinates, finished as `spec` finishes a batch: asked of
    each server in turn until one delivers it (see _first_answer)."""
    def ask(server: Server, left: float) -> Any:
        answer = _Answer(index)
        stream = BatchStream(server.channel, server.address, spec, answer.on_batch,
                             answer.on_end)
        try:
            stream.credit([index])
            answer.done.wait(left)
        finally:
            stream.close()
        item = answer.item
        if item is not None and not isinstance(item, RemoteError):
            return item
        raise item or answer.ended or RemoteError(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {left:.3g}s", server.address)

    return _first_answer(servers, timeout, f"delivered batch {index} of epoch "
                         f"{spec.coordinates.epoch}", ask)


def ask_sources(servers: ServerSet, request: pb.ProvenanceRequest, timeout: float
                ) -> pb.ProvenanceResponse:
    """The Provenance answer of the first server that gives one (see _first_answer)."""
    def ask(server: Server, left: float) -> pb.ProvenanceResponse:
        try:
            return pb_grpc.DataServiceStub(server.channel).Provenance(request, timeout=left)
        except grpc.RpcError as e:
            raise RemoteError.from_rpc(e, server.address) from None

    return _first_answer(servers, timeout,
                         f"said where batch {request.batch_index} comes from", ask)


def _first_answer(servers: ServerSet, timeout: float, what: str,
                  ask: Callable[[Server, float], T]) -> T:
    """`ask(server, seconds left)` of each server in turn until one answers. Raises the
    RemoteError any server would repeat (FATAL codes, DATA_LOSS) at once; UNAVAILABLE
    naming every server's answer when none did (`what`) within `timeout` s in all."""
    deadline = time.monotonic() + timeout
    said: list[str] = []
    for server in list(servers.servers.values()):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            return ask(server, left)
        except RemoteError as error:
            if error.code in FATAL or error.code == grpc.StatusCode.DATA_LOSS:
                raise
            said.append(f"{server.address}: {error.code.name}: {error.details}")
    raise RemoteError(grpc.StatusCode.UNAVAILABLE, f"no server {what} within {timeout:g}s "
                      f"({'; '.join(said) or 'no server'})", servers.describe())
