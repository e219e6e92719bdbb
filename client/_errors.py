from __future__ import annotations

import grpc


class RemoteError(RuntimeError):
    """A data server refused or failed a request.

    `code` is the gRPC status (NOT_FOUND, INVALID_ARGUMENT, DATA_LOSS, UNAVAILABLE, ...);
    the message names the server and repeats what it said.
    """

    def __init__(self, code: grpc.StatusCode, details: str, address: str) -> None:
        super().__init__(f"{address}: {code.name}: {details}")
        self.code = code
        self.details = details
        self.address = address

    @classmethod
    def from_rpc(cls, err: grpc.RpcError, address: str) -> RemoteError:
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code, details or "", address)


class ProtocolError(ValueError):
    """A server sent something the protocol does not allow (a frame that does not parse, out
    of order, or whose header does not add up): nothing after it on that stream can be
    trusted. The message says which batch and what was wrong."""
