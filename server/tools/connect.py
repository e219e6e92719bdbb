"""First contact with a data server from the command line: one ListDatasets call with a short
deadline, and its failure turned into one line that names the address and says what to change
(gRPC's own words, "Socket closed" or "failed to connect to all addresses", do not).

`stoker datasets` and `stoker inspect` both start here, so a wrong address fails both the same
way within CONTACT_SECONDS, instead of `inspect` waiting out its batch timeout in silence.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A server that is up answers ListDatasets in milliseconds; a host that drops packets never
# does. Long enough for a TLS handshake across a slow network, short enough to feel like an
# answer.
CONTACT_SECONDS = 5.0
TLS_FLAGS = "--tls-ca CA.pem (or --tls, for a certificate signed by a system root)"


class ContactError(Exception):
    """A server that could not be reached or refused us; the message is for the user."""


@dataclass(frozen=True)
class Security:
    """What the command line says about TLS and the token, and where the token came from
    (the message for a refused token names it; never the token itself)."""

    tls: Any  # RemoteLoader's `tls`: False, True, or a dict of file paths
    token: str | None
    token_source: str | None  # "--token-file FILE" or "$STOKER_TOKEN"

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls)


def security(args: argparse.Namespace) -> Security:
    """RemoteLoader's `tls` and `token` from the command line (the token from a file, else
    $STOKER_TOKEN: never an argument, which other users of the machine can read in ps).
    ValueError for a file that cannot be read."""
    from stoker.client.channel import TOKEN_ENV, resolve_token

    token, source = None, None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as e:
            raise ValueError(f"--token-file {args.token_file}: {e.strerror}") from None
        source = f"--token-file {args.token_file}"
    elif resolve_token(None) is not None:
        source = f"${TOKEN_ENV}"
    files = {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key,
             "server_name": args.tls_server_name}
    files = {k: str(v) for k, v in files.items() if v is not None}
    return Security(files or args.tls, token, source)


def add_security(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", type=Path, metavar="FILE",
                        help="the bearer token (default: $STOKER_TOKEN)")
    parser.add_argument("--tls", action="store_true", help="TLS, checked against system roots")
    parser.add_argument("--tls-ca", type=Path, metavar="PEM", help="TLS, checked against this CA")
    parser.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="its private key")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="the name the server's certificate must carry")


def https_context(sec: Security, command: str) -> ssl.SSLContext | None:
    """The TLS context for reading a server's HTTP port with `sec`'s --tls options (None
    without TLS); ValueError, naming `command`, for files that do not load or an option the
    standard library's HTTP client cannot honour."""
    if not sec.uses_tls:
        return None
    files = sec.tls if isinstance(sec.tls, dict) else {}
    if files.get("server_name"):  # urllib checks the certificate against the URL's host only
        raise ValueError(f"{command}: --tls-server-name is not supported; give the address by "
                         "the name the certificate carries")
    try:
        context = ssl.create_default_context(cafile=files.get("ca"))
        if files.get("cert"):
            context.load_cert_chain(files["cert"], files.get("key"))
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"{command}: the --tls files do not load: {e}") from None
    return context


# What each cause of a failed connection (client/contact/diagnosis.py, which reads gRPC's
# words once for the loader and this command) asks the user to change, in this command's flags.
_CHANGE = {
    "REFUSED": "connection refused: no server listens there (is it running, and is this its "
               "gRPC port, `port:` in its config, 50051 by default?)",
    "UNRESOLVED": "cannot resolve the host name: {details}",
    "HTTP_PORT": "this is an HTTP port, not gRPC: give the server's gRPC port (`port:`, 50051 "
                 "by default; `http_port:` is for /metrics and `stoker stats`)",
    "NOT_TLS": "TLS handshake failed: the server does not use TLS; drop the --tls options",
    "UNTRUSTED": "TLS handshake failed: the server's certificate is not signed by a CA we "
                 "trust; pass --tls-ca CA.pem ({details})",
    "WRONG_NAME": "TLS handshake failed: the server's certificate does not name this host; "
                  "pass --tls-server-name NAME ({details})",
    "TLS": "TLS handshake failed: check --tls-ca, --tls-server-name and, for mutual TLS, "
           "--tls-cert/--tls-key ({details})",
}


def explain(address: str, code: str, details: str, sec: Security, seconds: float,
            connected: bool = False) -> str:
    """One line for a failed first call: gRPC status `code` (its name) and `details`;
    `connected`: its channel was READY (a connection made) when the call failed."""
    from stoker.client.contact.diagnosis import Cause, cause

    if code == "UNAUTHENTICATED":
        if sec.token_source is None:
            return (f"{address}: UNAUTHENTICATED: the server needs a token: pass --token-file "
                    "FILE or set $STOKER_TOKEN")
        return (f"{address}: UNAUTHENTICATED: the server refused the token from "
                f"{sec.token_source}: is it the server's auth_token_file?")
    if code == "DEADLINE_EXCEEDED":
        if connected:
            return (f"{address}: connected, but no answer within {seconds:g} s: is the server "
                    "stopped or overloaded?")
        return (f"{address}: no answer within {seconds:g} s: a wrong host or port, or a "
                "firewall dropping the packets?")
    if code != "UNAVAILABLE" or connected:  # the server's own status
        return f"{address}: {code}: {details}"
    found = cause(details)
    if found is Cause.CLOSED:
        if not sec.uses_tls:
            return (f"{address}: the server closed the connection at once: it may need TLS; "
                    f"pass {TLS_FLAGS}")
        return (f"{address}: the server closed the TLS connection: if it requires client "
                "certificates (client_ca_file), pass --tls-cert and --tls-key")
    if found is not None:
        return f"{address}: " + _CHANGE[found.name].format(details=details)
    return f"{address}: UNAVAILABLE: {details}"


def first_contact(address: str, sec: Security, timeout: float = CONTACT_SECONDS) -> Any:
    """The server's ListDatasets reply; ContactError with a one-line explanation if the
    server cannot be reached or refuses the call within `timeout` seconds."""
    import grpc

    from stoker.client.channel import ChannelMaker
    from stoker.client.contact.diagnosis import Connectivity
    from stoker.v1 import stoker_pb2 as pb
    from stoker.v1 import stoker_pb2_grpc as pb_grpc

    channel = ChannelMaker(sec.tls, sec.token)(address, [])
    watch = Connectivity(channel)
    with channel:  # the state is read before the channel closes (a closed one has none)
        try:
            return pb_grpc.DataServiceStub(channel).ListDatasets(pb.ListDatasetsRequest(),
                                                                 timeout=timeout)
        except grpc.RpcError as e:
            raise ContactError(explain(address, e.code().name, e.details() or "", sec,
                                       timeout, watch.state is grpc.ChannelConnectivity.READY)
                               ) from None
