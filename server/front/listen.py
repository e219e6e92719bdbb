"""The server's own listening TCP sockets (HTTP, data socket), made one way.

A socket listens from the moment it is made, before the server reports ready: a client that
connects as soon as it reads the ready line waits in the backlog instead of being refused.
SO_REUSEADDR lets a restarted server bind while its predecessor's connections sit in
TIME_WAIT; SO_REUSEPORT is never set: a second server on a taken port must fail, not share it.
"""

from __future__ import annotations

import socket

__all__ = ["address", "listen", "taken"]

BACKLOG = 128


def address(host: str, port: int) -> str:
    """host:port as gRPC and messages write it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening; port 0: any free port.
    Raises OSError (the socket is closed then)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def taken(host: str, port: int) -> str:
    """Why (host, port) cannot be listened on now, e.g. "Address already in use"; "" if it
    can. The probe's socket is closed at once (a listener with no connection leaves no
    TIME_WAIT behind)."""
    try:
        listen(host, port).close()
    except OSError as e:
        return e.strerror or str(e)
    return ""
