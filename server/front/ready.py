"""What a stream's reader hands its sender: the items of the ready queue, in the order they
become ready. Each is a small frozen dataclass; `Ready` is their union, which the sender
matches on (server/front/sender.py).

The names say what each is to the stream, apart from the pool's messages
(server/pool/messages.py: `Built`, a worker's answer) and the limits' refusal
(server/front/limits.py: `Refused`, a call not admitted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from ..pool.layout import BuiltBatch


@dataclass(frozen=True)
class ReadyBatch:
    """A batch ready to send."""

    batch: BuiltBatch
    batch_index: int
    epoch: int


@dataclass(frozen=True)
class FailedBatch:
    """A batch that could not be built: answered in-band, the stream goes on. `detail`: what
    the server's log says instead of `message` (the full text: paths, the traceback)."""

    batch_index: int
    epoch: int
    code: grpc.StatusCode
    message: str
    detail: str = ""


@dataclass(frozen=True)
class Offer:
    """A frame that answers no credit: the data socket's offer."""

    frame: bytes


@dataclass(frozen=True)
class RefusedCall:
    """The reader refused a request: the call ends with this status."""

    code: grpc.StatusCode
    message: str
    trailers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Accepted:
    """The first coordinates passed: the stream's initial metadata may go out."""


@dataclass(frozen=True)
class Finished:
    """The client half-closed: the stream ends once every credit is answered."""


Ready = ReadyBatch | FailedBatch | Offer | RefusedCall | Finished | Accepted
