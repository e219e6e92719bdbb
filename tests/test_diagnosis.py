"""Connection diagnosis (client/contact/diagnosis.py), shared by the loader and the `stoker`
command: whether a failed call reached a server is read from the channel's connectivity
state, and which step failed from gRPC's words, in one place. Plain gRPC servers on loopback
port 0; no stoker server."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from stoker.client._errors import RemoteError
from stoker.client.contact.diagnosis import Cause, Connectivity, cause, explain, hint, reached
from stoker.server.tools.connect import Security
from stoker.server.tools.connect import explain as cli_explain

READY = grpc.ChannelConnectivity.READY
FAILED = grpc.ChannelConnectivity.TRANSIENT_FAILURE
METHOD = "/test.Probe/Call"


@pytest.fixture
def unavailable_server() -> Iterator[str]:
    """A gRPC server whose one method answers UNAVAILABLE itself (as a draining server does)."""

    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAVAILABLE, "draining: ask another server")

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Probe", {"Call": grpc.unary_unary_rpc_method_handler(call)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def refused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def failed_call(channel: grpc.Channel, address: str) -> RemoteError:
    with pytest.raises(grpc.RpcError) as e:
        channel.unary_unary(METHOD)(b"", timeout=5)
    return RemoteError.from_rpc(e.value, address)


def wait_for_state(watch: Connectivity, wanted: grpc.ChannelConnectivity) -> bool:
    return watch.wait_for(wanted, timeout=5.0)


def test_an_unavailable_the_server_answered_itself_counts_as_reached(unavailable_server):
    with grpc.insecure_channel(unavailable_server) as channel:
        watch = Connectivity(channel)
        err = failed_call(channel, unavailable_server)
        assert err.code == grpc.StatusCode.UNAVAILABLE
        assert wait_for_state(watch, READY)
        assert reached(err, watch.state)
        # The address line then says what the server said, not what TCP found.
        assert explain(unavailable_server, err, tls=False, state=watch.state) == (
            f"{unavailable_server}: UNAVAILABLE: draining: ask another server")
        watch.close()


def test_an_unavailable_with_no_connection_is_not_reached_whatever_its_words():
    address = refused_address()
    with grpc.insecure_channel(address) as channel:
        watch = Connectivity(channel)
        err = failed_call(channel, address)
        assert wait_for_state(watch, FAILED)
        assert not reached(err, watch.state)
        # The same words, from a READY channel, would be the server's own.
        assert reached(err, READY)
        line = explain(address, err, tls=False, state=watch.state)
        assert line == f"{address}: refused the connection (nothing listens on that port)"
        watch.close()


def test_without_a_state_the_words_decide():
    said = RemoteError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; "
                       "last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect", "a:1")
    assert not reached(said)
    assert reached(RemoteError(grpc.StatusCode.UNAVAILABLE, "draining", "a:1"))
    assert not reached(RemoteError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded",
                                   "a:1"), READY)
    assert reached(RemoteError(grpc.StatusCode.NOT_FOUND, "no dataset 'x'", "a:1"), FAILED)


@pytest.mark.parametrize(("details", "expected"), [
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: "
     "Failed to connect to remote host: Connection refused", Cause.REFUSED),
    ("DNS resolution failed for no-such-host.invalid:50051", Cause.UNRESOLVED),
    ("Trying to connect an http1.x server", Cause.HTTP_PORT),
    ("Ssl handshake failed: SSL_ERROR_SSL: error:100000f7:SSL routines:"
     "OPENSSL_internal:WRONG_VERSION_NUMBER", Cause.NOT_TLS),
    ("Ssl handshake failed: error:1000007d:SSL routines:OPENSSL_internal:"
     "CERTIFICATE_VERIFY_FAILED", Cause.UNTRUSTED),
    ("Peer name localhost is not in peer certificate", Cause.WRONG_NAME),
    ("Socket closed", Cause.CLOSED),
    ("Connection reset by peer", Cause.CLOSED),
    ("Ssl handshake failed: SSL_ERROR_SSL", Cause.TLS),
    ("draining: ask another server", None),
])
def test_cause_reads_which_step_failed(details, expected):
    assert cause(details) is expected


def test_hint_follows_the_cause():
    assert "pass tls=True" in hint(False, "UNAVAILABLE: Socket closed")
    assert hint(False, "UNAVAILABLE: Connection refused") == ""
    assert "tls['ca']" in hint(True, "UNAVAILABLE: CERTIFICATE_VERIFY_FAILED")
    assert "tls['ca']" in hint(True, "no answer", reachable=True)
    assert hint(True, "UNAVAILABLE: Connection refused") == ""


def test_the_cli_words_each_cause_in_its_flags():
    plain = Security(tls=False, token=None, token_source=None)
    tls = Security(tls={"ca": "ca.pem"}, token=None, token_source=None)
    a = "h:1"
    assert cli_explain(a, "UNAVAILABLE", "Connection refused", plain, 5).startswith(
        "h:1: connection refused: no server listens there")
    assert "drop the --tls options" in cli_explain(a, "UNAVAILABLE", "WRONG_VERSION_NUMBER",
                                                   tls, 5)
    assert "may need TLS" in cli_explain(a, "UNAVAILABLE", "Socket closed", plain, 5)
    assert "--tls-cert and --tls-key" in cli_explain(a, "UNAVAILABLE", "Socket closed", tls, 5)
    assert "--tls-server-name NAME" in cli_explain(a, "UNAVAILABLE", "peer name x", tls, 5)
    # A READY channel: the status is the server's own, whatever its words.
    assert cli_explain(a, "UNAVAILABLE", "Socket closed", plain, 5, connected=True) == (
        "h:1: UNAVAILABLE: Socket closed")
    assert cli_explain(a, "DEADLINE_EXCEEDED", "", plain, 5).startswith(
        "h:1: no answer within 5 s: a wrong host or port")
    assert cli_explain(a, "DEADLINE_EXCEEDED", "", plain, 5, connected=True).startswith(
        "h:1: connected, but no answer within 5 s")
