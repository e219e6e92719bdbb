"""Why a server cannot be reached, said in words a user can act on; one module for the loader
and the `stoker` command (server/tools/connect.py words the same findings for its flags).

- `Connectivity`: a channel's connectivity state as gRPC reports it (`Channel.subscribe`):
  READY once a connection (TCP, TLS, HTTP/2) is up, TRANSIENT_FAILURE when making one failed.
- `reached`: did a failed call get to the server's code at all? From the status code, then
  the channel's state; gRPC's words only where no state is known.
- `cause`: which step of making the connection failed (refused, no such name, an HTTP port,
  a TLS mismatch...). gRPC says *that* it failed (UNAVAILABLE, TRANSIENT_FAILURE) but not
  which step: that is in its error text alone, so this is the one place that reads the text.
- `diagnose`: a plain TCP connect to every address a name resolves to. gRPC's own error names
  only the last address it tried (for `localhost`, often `[::1]`, refused, while `127.0.0.1`
  failed its TLS handshake), so the loader's error is built from these connects.
- `explain` (one address's line in the loader's error when no server answered) and `hint`
  (what a TLS mismatch looks like, in the loader's arguments).

Threading: the loop's thread (first contact's), or a CLI's; `Connectivity` is updated from
gRPC's threads.
"""

from __future__ import annotations

import enum
import socket
import time
from dataclasses import dataclass

import grpc

from .._errors import RemoteError

PROBE_TIMEOUT = 1.0  # seconds a diagnostic TCP connect may take
_READY = grpc.ChannelConnectivity.READY


class Connectivity:
    """The connectivity state of `channel`, read from gRPC when asked (`state`).

    Read, not subscribed to: `Channel.subscribe` runs a gRPC polling thread that outlives an
    unsubscribe by up to 0.2 s and raises "Cannot monitor channel state: Channel closed!" in
    that thread when the channel closes meanwhile (the loader closes its channels right after
    a failed first contact). gRPC's public API has no other way to read the state, so this
    reads the core channel's `check_connectivity_state` behind grpc's channel (and an
    interceptor's wrapper); where that is not there, `state` is None and the diagnosis falls
    back to gRPC's words."""

    def __init__(self, channel: grpc.Channel) -> None:
        core: object = channel
        for _ in range(4):  # grpc.intercept_channel's wrapper -> grpc's Channel -> cygrpc's
            if hasattr(core, "check_connectivity_state"):
                break
            core = getattr(core, "_channel", None)
        self._core = core if hasattr(core, "check_connectivity_state") else None

    @property
    def state(self) -> grpc.ChannelConnectivity | None:
        if self._core is None:
            return None
        try:
            from grpc._common import CYGRPC_CONNECTIVITY_STATE_TO_CHANNEL_CONNECTIVITY as BY
            return BY.get(self._core.check_connectivity_state(False))
        except (ImportError, ValueError, AttributeError):  # closed, or another grpc
            return None

    def wait_for(self, state: grpc.ChannelConnectivity, timeout: float) -> bool:
        """Whether the channel is in `state` within `timeout` s (looked at every 10 ms)."""
        deadline = time.monotonic() + timeout
        while self.state is not state:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Nothing to release (kept for the callers' symmetry)."""


def reached(err: RemoteError, state: grpc.ChannelConnectivity | None = None) -> bool:
    """The server's code answered (a status of its own), rather than gRPC saying that no
    connection was made. DEADLINE_EXCEEDED counts as no answer: a frozen process, or a port
    that accepts connections and never speaks gRPC. An UNAVAILABLE is the server's own (it is
    draining, say) when its channel is READY, and gRPC's when it is not; `state`: the
    channel's, when known (`Connectivity`)."""
    if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return False
    if err.code != grpc.StatusCode.UNAVAILABLE:
        return True
    if state is not None:
        return state is _READY
    # No state known: gRPC's words are all there is.
    return cause(err.details) is None and not any(w in err.details.lower() for w in _UNREACHED)


class Cause(enum.Enum):
    """The step of making a connection that failed, as gRPC's words tell it."""

    REFUSED = "connection refused"
    UNRESOLVED = "the host name does not resolve"
    HTTP_PORT = "an HTTP port, not gRPC"
    NOT_TLS = "the server does not use TLS"
    UNTRUSTED = "the server's certificate is not signed by a CA we trust"
    WRONG_NAME = "the server's certificate does not name this host"
    CLOSED = "the server closed the connection at once"
    TLS = "the TLS handshake failed"


# gRPC's words for each cause (lower case), in the order they are tried: the first that
# matches wins (a TLS error's text may also say "socket closed").
_WORDS: tuple[tuple[Cause, tuple[str, ...]], ...] = (
    (Cause.REFUSED, ("connection refused",)),
    (Cause.UNRESOLVED, ("errors resolving", "dns resolution failed", "resolving", "lookup",
                        "name not found")),
    (Cause.HTTP_PORT, ("http1.x server", "failed parsing http/2")),
    (Cause.NOT_TLS, ("wrong_version_number",)),
    (Cause.UNTRUSTED, ("certificate_verify_failed", "unable to get local issuer")),
    (Cause.WRONG_NAME, ("peer name", "hostname")),
    (Cause.CLOSED, ("socket closed", "connection reset")),
    (Cause.TLS, ("handshake", "ssl", "tls", "certificate")),
)
# Other words of gRPC's for a call that never reached a server's code, naming no cause.
_UNREACHED = ("failed to connect", "end of tcp stream", "connections to all backends failing",
              "no route to host", "unreachable", "timeout occurred", "broken pipe")


def cause(details: str) -> Cause | None:
    """Which step of making a connection failed, from gRPC's error text (None: it does not
    say). gRPC gives no code or state for the step, only these words."""
    low = details.lower()
    for found, words in _WORDS:
        if any(w in low for w in words) or (
                found is Cause.NOT_TLS and "handshake" in low and "version" in low):
            return found
    return None


_TLS_CAUSES = frozenset({Cause.NOT_TLS, Cause.UNTRUSTED, Cause.WRONG_NAME, Cause.CLOSED,
                         Cause.TLS})


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


def explain(address: str, err: RemoteError | None, tls: bool,
            state: grpc.ChannelConnectivity | None = None) -> str:
    """`address: what happened`, for the error raised when no server answered; `state`: its
    channel's connectivity, when known."""
    if err is not None and reached(err, state):
        return f"{address}: {err.code.name}: {err.details}"
    probes = diagnose(address)
    said = "; ".join(str(p) for p in probes)
    if len(probes) == 1 and probes[0].address == address:  # an "ip:port" address
        said = said.removeprefix(f"{address} ")
    if not any(p.outcome is Outcome.ACCEPTED for p in probes):
        return f"{address}: {said}"
    grpc_said = f"{err.code.name}: {err.details}" if err is not None else "no answer"
    text = f"{address}: {said}, but no gRPC call got through (gRPC: {grpc_said})"
    return text + hint(tls, grpc_said, reachable=True)


def hint(tls: bool, errors: str, *, reachable: bool = False) -> str:
    """A sentence to append to a connection failure that looks like a TLS mismatch ("" if it
    does not): gRPC's own words ("Socket closed") do not say what to change. `reachable`: the
    address accepts TCP connections, yet no call got through, whatever gRPC's words say (they
    may be about another address of the same name: `localhost` is [::1] and 127.0.0.1)."""
    found = cause(errors)
    if not tls and reachable:
        return (" (if the server uses TLS, pass tls=True or tls={'ca': ...}; else check that "
                "this is its gRPC port, not its HTTP port, and that the server is not stopped)")
    if not tls and found is Cause.CLOSED:
        return (" (the server closed the connection at once: if it uses TLS, pass tls=True "
                "or tls={'ca': ...})")
    if tls and (reachable or found in _TLS_CAUSES):
        return (" (TLS handshake failed: check tls['ca'] signs the server's certificate and "
                "tls['server_name'] matches it; a server with client_ca_file needs tls['cert'] "
                "and tls['key']; a server without TLS needs tls=False)")
    return ""
