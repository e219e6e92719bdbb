"""Why a server cannot be reached, said in words a user can act on: `reached` (did a call get
to the server's code at all), `diagnose` (a plain TCP connect to every address a name resolves
to), `explain` (one address's line in the error when no server answered) and `hint` (what a
TLS mismatch looks like).

gRPC's own error names only the last address it tried (for `localhost`, often `[::1]`,
refused, while `127.0.0.1` failed its TLS handshake), so the error is built from the TCP
connects.

Threading: the loop's thread (first contact's), or a CLI's.
"""

from __future__ import annotations

import enum
import socket
from dataclasses import dataclass

import grpc

from .._errors import RemoteError

PROBE_TIMEOUT = 1.0  # seconds a diagnostic TCP connect may take
# gRPC's words for a call that never reached a server's code: no connection, no name, no TLS.
_UNREACHED = ("failed to connect", "errors resolving", "dns resolution failed", "socket closed",
              "connection reset", "connection refused", "broken pipe", "handshake", "ssl",
              "end of tcp stream", "connections to all backends failing", "no route to host",
              "unreachable", "timeout occurred")


def reached(err: RemoteError) -> bool:
    """The server's code answered (a status of its own), rather than gRPC saying that no
    connection was made. DEADLINE_EXCEEDED counts as no answer: a frozen process, or a port
    that accepts connections and never speaks gRPC."""
    if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return False
    if err.code != grpc.StatusCode.UNAVAILABLE:
        return True
    low = err.details.lower()
    return not any(w in low for w in _UNREACHED)


class Outcome(enum.Enum):
    """What a plain TCP connect to one address found; the value is how errors say it."""

    ACCEPTED = "accepts TCP connections"
    REFUSED = "refused the connection (nothing listens on that port)"
    SILENT = f"did not answer a TCP connect within {PROBE_TIMEOUT:g}s (a firewall, or no such host)"
    UNRESOLVED = "does not resolve"
    FAILED = "cannot be connected to"


@dataclass(frozen=True)
class Probe:
    """One resolved address (or the name, when it does not resolve) and what was found."""

    address: str
    outcome: Outcome
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.address} {self.outcome.value}" + (f" ({self.detail})" if self.detail
                                                          else "")


def diagnose(address: str, timeout: float = PROBE_TIMEOUT) -> list[Probe]:
    """A plain TCP connect to every address `address` ("host:port", "[v6]:port" or a dns:
    target) resolves to, each within `timeout` s."""
    host, _, port = address.removeprefix("dns:///").removeprefix("dns:").rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        return [Probe(f"{host!r}", Outcome.UNRESOLVED, getattr(e, "strerror", None) or str(e))]
    probes = []
    for family, kind, proto, _, sockaddr in dict.fromkeys(infos):  # dedupe, keep order
        ip = sockaddr[0]
        where = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout)
            try:
                s.connect(sockaddr)
            except ConnectionRefusedError:
                probes.append(Probe(where, Outcome.REFUSED))
            except TimeoutError:
                probes.append(Probe(where, Outcome.SILENT))
            except OSError as e:
                probes.append(Probe(where, Outcome.FAILED, e.strerror or str(e)))
            else:
                probes.append(Probe(where, Outcome.ACCEPTED))
    return probes


def explain(address: str, err: RemoteError | None, tls: bool) -> str:
    """`address: what happened`, for the error raised when no server answered."""
    if err is not None and reached(err):
        return f"{address}: {err.code.name}: {err.details}"
    probes = diagnose(address)
    said = "; ".join(str(p) for p in probes)
    if len(probes) == 1 and probes[0].address == address:  # an "ip:port" address
        said = said.removeprefix(f"{address} ")
    if not any(p.outcome is Outcome.ACCEPTED for p in probes):
        return f"{address}: {said}"
    grpc_said = f"{err.code.name}: {err.details}" if err is not None else "no answer"
    text = f"{address}: {said}, but no gRPC call got through (gRPC: {grpc_said})"
    return text + (hint(tls, grpc_said, reachable=True) if err is None or not reached(err)
                   else "")


def hint(tls: bool, errors: str, *, reachable: bool = False) -> str:
    """A sentence to append to a connection failure that looks like a TLS mismatch ("" if it
    does not): gRPC's own words ("Socket closed") do not say what to change. `reachable`: the
    address accepts TCP connections, yet no call got through, whatever gRPC's words say (they
    may be about another address of the same name: `localhost` is [::1] and 127.0.0.1)."""
    low = errors.lower()
    if not tls and reachable:
        return (" (if the server uses TLS, pass tls=True or tls={'ca': ...}; else check that "
                "this is its gRPC port, not its HTTP port, and that the server is not stopped)")
    if not tls and "socket closed" in low:
        return (" (the server closed the connection at once: if it uses TLS, pass tls=True "
                "or tls={'ca': ...})")
    if tls and (reachable or any(w in low for w in ("handshake", "ssl", "certificate",
                                                    "socket closed"))):
        return (" (TLS handshake failed: check tls['ca'] signs the server's certificate and "
                "tls['server_name'] matches it; a server with client_ca_file needs tls['cert'] "
                "and tls['key']; a server without TLS needs tls=False)")
    return ""
