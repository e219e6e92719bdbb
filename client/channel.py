"""How a channel to a data server is made: plain or TLS, with the bearer token on every call.

    tls=False                     plain TCP (the default; a trusted network only)
    tls=True                      TLS, the server's certificate checked against system roots
    tls={"ca": "ca.pem"}          ... against these CA certificates instead
    tls={..., "cert": "client.pem", "key": "client.key"}   mutual TLS: present this one
    tls={..., "server_name": "stoker-data"}   the name the certificate must carry, when the
                                  address is an IP or another name (grpc.ssl_target_name_override)

The token (argument, else the STOKER_TOKEN environment variable) goes out as
`authorization: Bearer <token>` metadata on every call, by a client interceptor, so no call
site can forget it. The data connections (client/transport/datalink.py) use the same settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from .transport.datalink import DataLink, client_context

TOKEN_ENV = "STOKER_TOKEN"
TLS_KEYS = ("ca", "cert", "key", "server_name")


def resolve_token(token: str | None) -> str | None:
    """`token`, else $STOKER_TOKEN, else None; surrounding whitespace dropped."""
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    token = token.strip() if token else None
    if token is not None and any(c.isspace() for c in token):
        raise ValueError("token: contains whitespace")
    return token or None


def _read(tls: Mapping[str, Any], key: str) -> bytes | None:
    if tls.get(key) is None:
        return None
    try:
        return Path(tls[key]).expanduser().read_bytes()
    except OSError as e:
        raise ValueError(f"tls[{key!r}]: cannot read {tls[key]}: {e.strerror}") from None


def credentials(tls: bool | Mapping[str, Any] | None
                ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    """(channel credentials or None for plain TCP, extra channel options) for `tls`; the
    files are read here, once."""
    if tls is None or tls is False:
        return None, []
    if tls is True:
        return grpc.ssl_channel_credentials(), []
    if not isinstance(tls, Mapping):
        raise ValueError(f"tls: expected True, False or a dict with keys {TLS_KEYS}, "
                         f"got {tls!r}")
    unknown = sorted(set(tls) - set(TLS_KEYS))
    if unknown:
        raise ValueError(f"tls: unknown keys {unknown}; expected some of {TLS_KEYS}")
    if (tls.get("cert") is None) != (tls.get("key") is None):
        raise ValueError("tls: give both 'cert' and 'key' (a client certificate), or neither")
    creds = grpc.ssl_channel_credentials(root_certificates=_read(tls, "ca"),
                                         private_key=_read(tls, "key"),
                                         certificate_chain=_read(tls, "cert"))
    options = []
    if tls.get("server_name"):
        options.append(("grpc.ssl_target_name_override", str(tls["server_name"])))
    return creds, options


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
              grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class ChannelMaker:
    """Makes channels with one loader's TLS settings and token (files read once)."""

    def __init__(self, tls: bool | Mapping[str, Any] | None = None,
                 token: str | None = None) -> None:
        self.credentials, self._tls_options = credentials(tls)
        self.token = resolve_token(token)
        # The data connections: the same roots, client certificate, server name and token.
        self.link = DataLink(client_context(tls),
                             str(tls["server_name"]) if isinstance(tls, Mapping)
                             and tls.get("server_name") else None, self.token)

    @property
    def tls(self) -> bool:
        return self.credentials is not None

    def __call__(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        options = [*options, *self._tls_options]
        channel = (grpc.insecure_channel(address, options=options) if self.credentials is None
                   else grpc.secure_channel(address, self.credentials, options=options))
        return channel if self.token is None else grpc.intercept_channel(
            channel, _Bearer(self.token))
