"""How the front end refuses a request: `Abort` carries the gRPC status, its message and its
trailing metadata to the one place that ends the call with them (a unary method's handler, a
stream's sender).

Raised by the coordinate checks (server/front/service.py) and a stream's reader
(server/front/session.py); imported by both, so neither imports the other for it.
"""

from __future__ import annotations

import grpc

# Initial metadata of an accepted stream, trailing metadata of one refused for its data:
# the dataset's fingerprint digest as this server has it.
# Answers the log warns about, one line each: the client cannot go on, and the operator
# should know why (a bad sample, a limit).
WARNED = (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED)


class Abort(Exception):
    """A request refused with a gRPC status (and `trailers`, trailing metadata): the call
    ends with it."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.trailers = trailers
