"""First contact: the dataset's description from the first server that answers; when none
does, an error that says what happened at every address.

Until some server has answered at all, a loader waits at most `connect_timeout`: an address
nothing listens on, a name that does not resolve or a TLS mismatch do not mend by waiting, and
a mistyped port must not look like a frozen trainer. Once a server has answered (with its own
status, even UNAVAILABLE), `timeout` applies, as it does for the rest of the run (a server
restarting). gRPC's own error names only the last address it tried (for `localhost`, often
`[::1]`, refused, while `127.0.0.1` failed its TLS handshake), so the error is built from a
plain TCP connect to each address the name resolves to, by `diagnose`.

Threading: the loop's thread (the loader's).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import stoker_pb2_grpc as pb_grpc

from .._backoff import MOST, Backoff
from .._errors import RemoteError
from .._log import say
from ..fleet.servers import Server, ServerSet
from .diagnosis import Connectivity, explain, reached

CALL_TIMEOUT = 10.0  # seconds one DescribeDataset may take
PAUSE_MAX = MOST  # seconds: the longest pause (_backoff.py), and the longest wait for an answer
@dataclass(frozen=True)
class Contact:
    """The first description, the server that gave it, and the same question's calls to the
    other servers still in flight (address -> future; their answers are for the agreement's
    fingerprint check, client/contact/agreement.py)."""

    described: pb.DescribeDatasetResponse
    server: Server
    pending: dict[str, grpc.Future] = field(default_factory=dict)


def first_contact(servers: ServerSet, request: Callable[[], pb.DescribeDatasetRequest], *,
                  connect_timeout: float, timeout: float, tls: bool,
                  refuse: Callable[[RemoteError], None]) -> Contact:
    """DescribeDataset of every server at once, each asked again with its own backoff after
    it fails, until one answers: the first answer wins, so an address that black-holes (a
    host gone, a firewall) costs nothing while another answers.

    `refuse(error)` sees every error a server answered and raises what must not be retried
    (FATAL codes, a DataMismatch). Gives up with UNAVAILABLE after `connect_timeout` s while
    no server has answered at all, after `timeout` s once one has; the error names every
    address, what it answered or what a TCP connect to each of its addresses found."""
    started = time.monotonic()
    errors: dict[str, RemoteError] = {}
    answers: queue.SimpleQueue[tuple[Server, grpc.Future]] = queue.SimpleQueue()
    asked: dict[str, grpc.Future] = {}  # address -> its call in flight
    due: dict[str, float] = {}  # address -> when to ask it again
    pauses: dict[str, Backoff] = {}
    # Each asked server's channel state, from gRPC: whether its error is the server's own.
    watched: dict[str, Connectivity] = {}
    answered = said_waiting = False
    try:
        while True:
            now = time.monotonic()
            waited = now - started
            limit = timeout if answered else min(connect_timeout, timeout)
            if waited < limit:
                for server in list(servers.servers.values()):
                    if server.address not in asked and due.get(server.address, 0.0) <= now:
                        due.pop(server.address, None)
                        if server.address not in watched:
                            watched[server.address] = Connectivity(server.channel)
                        asked[server.address] = _ask(server, request(), answers,
                                                     min(CALL_TIMEOUT, limit - waited))
            # Wake for the next server due again, to give up in time, to look at a dns name
            # now and then; past the limit, only for the calls in flight (their deadlines end
            # them by then). About a second in, say what it waits for.
            wake = min([*due.values(), started + limit]) if waited < limit else now + PAUSE_MAX
            if not said_waiting and waited >= 1.0:
                said_waiting = True
                last = "; ".join(str(e) for e in errors.values()) or "no answer yet"
                say(logging.INFO, "waiting up to %gs more for a data server at %s to answer "
                    "(%s)", round(limit - waited, 1), servers.describe(), last)
            elif not said_waiting:
                wake = min(wake, started + 1.0)
            if waited >= limit and not asked:
                raise _none_answered(servers, errors, watched, waited, answered,
                                     connect_timeout, timeout, tls)
            try:
                server, future = answers.get(timeout=min(max(wake - now, 0.01), PAUSE_MAX))
            except queue.Empty:
                servers.refresh(time.monotonic())
                continue
            if server.address not in asked or asked[server.address] is not future:
                continue
            del asked[server.address]
            try:
                return Contact(future.result(), server, asked)
            except grpc.RpcError as e:
                err = RemoteError.from_rpc(e, server.address)
            say(logging.DEBUG, "DescribeDataset at %s: %s", server.address, err)
            refuse(err)
            answered = answered or reached(err, watched[server.address].state)
            errors[server.address] = err
            due[server.address] = time.monotonic() + pauses.setdefault(
                server.address, Backoff()).next()
    except BaseException:
        for call in asked.values():
            call.cancel()
        raise


def _ask(server: Server, request: pb.DescribeDatasetRequest,
         answers: queue.SimpleQueue[tuple[Server, grpc.Future]], timeout: float) -> grpc.Future:
    """DescribeDataset of `server`, its end put on `answers` (from a gRPC thread)."""
    future = pb_grpc.DataServiceStub(server.channel).DescribeDataset.future(
        request, timeout=max(timeout, 0.05))
    future.add_done_callback(lambda f: answers.put((server, f)))
    return future


def _none_answered(servers: ServerSet, errors: dict[str, RemoteError],
                   watched: dict[str, Connectivity], waited: float, answered: bool,
                   connect_timeout: float, timeout: float, tls: bool) -> RemoteError:
    bound = (f"timeout={timeout:g}" if answered or timeout <= connect_timeout
             else f"connect_timeout={connect_timeout:g}")
    if servers.servers:
        parts = [explain(a, errors.get(a), tls, w.state if (w := watched.get(a)) else None)
                 for a in servers.servers]
    else:  # a dns: target that resolves to nothing
        parts = [explain(servers.describe(), None, tls)]
    return RemoteError(grpc.StatusCode.UNAVAILABLE,
                       f"no data server answered in {waited:.1f}s ({bound}): "
                       + "; ".join(parts), servers.describe())
