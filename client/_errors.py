from __future__ import annotations

import grpc

from stoker.v1.wire import FINGERPRINT_KEY


class RemoteError(RuntimeError):
    """A data server refused or failed a request.

    `code` is the gRPC status (NOT_FOUND, INVALID_ARGUMENT, DATA_LOSS, UNAVAILABLE, ...);
    the message names the server and repeats what it said. Where the user's own code raised
    on the server (a `format: python` dataset, a `transform:`), what it said ends with that
    exception's traceback, as DataLoader shows a worker's: `remote_traceback` is that part
    (from "Traceback (most recent call last):" on), else None.

    Example::

        try:
            batch = loader.batch_at(0, 10**9)
        except RemoteError as err:
            if err.code == grpc.StatusCode.INVALID_ARGUMENT:
                print(err.details)  # "batch_index: ..."

    Args:
        code: the call's gRPC status.
        details: what the server said.
        address: the server's address.

    Attributes:
        code: the call's gRPC status.
        details: what the server said.
        address: the server's address.
        remote_traceback: the traceback of the user's code that raised on the server, or
            None.
    """

    def __init__(self, code: grpc.StatusCode, details: str, address: str) -> None:
        super().__init__(f"{address}: {code.name}: {details}")
        self.code = code
        self.details = details
        self.address = address
        at = details.find("\nTraceback (most recent call last):")
        self.remote_traceback: str | None = details[at + 1:] if at >= 0 else None

    @classmethod
    def from_rpc(cls, err: grpc.RpcError, address: str) -> RemoteError:
        """The error a call ended with; a DataMismatch where the server refused it for
        holding other data than the client expects (its trailing metadata names its digest).

        Args:
            err: the failed call's error (a grpc.Call, with code, details, trailers).
            address: the server's address.

        Returns:
            A RemoteError, or a DataMismatch.
        """
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        trailers = dict(err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") \
            else {}
        digest = trailers.get(FINGERPRINT_KEY)
        if code == grpc.StatusCode.FAILED_PRECONDITION and isinstance(digest, str):
            return DataMismatch(details or "", address, digest)
        return cls(code, details or "", address)


# A server's dataset fingerprint digest: initial metadata of an accepted stream, trailing
# metadata of a call refused because the client expects another one.


class DataMismatch(RemoteError):
    """Servers (or a server and a checkpoint) hold different data for one dataset: different
    fingerprints, from listings taken at different times or different configs. One loader
    must not mix them: sample indices would name different samples, so samples would repeat
    or go missing. `digest` is the fingerprint the server at `address` has.

    Args:
        details: what was found (the message names both fingerprints where it can).
        address: the server's address.
        digest: the fingerprint digest that server has.

    Attributes:
        digest: the fingerprint digest the server at `address` has (and, as a RemoteError,
            `code` FAILED_PRECONDITION, `details`, `address`).
    """

    def __init__(self, details: str, address: str, digest: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, details, address)
        self.digest = digest


class ProtocolError(ValueError):
    """A server sent something the protocol does not allow (a frame that does not parse, out
    of order, or whose header does not add up): nothing after it on that stream can be
    trusted. The message says which batch and what was wrong.

    Args:
        *args: the message (as ValueError's).
    """


class ConnectionCut(ProtocolError):
    """The data connection ended inside a record: the connection broke (the server went
    away, say), where a plain ProtocolError means the server broke the protocol. A
    ProtocolError still, since what the record began cannot be used either."""
