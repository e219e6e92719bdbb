"""TLS for the gRPC port and the HTTP control plane, from the `server.tls` settings.

The files are read once, at start: a certificate or key that does not load fails the start
naming the file, instead of every handshake failing later. With `client_ca_file` both ports
require a client certificate that CA signed (mutual TLS); the HTTP port too, so its probes
then need one as well (docs/security.md says what to probe with).

The data connections use the same files and rule (server_context).
"""

from __future__ import annotations

import ssl
from typing import Any

import grpc

from .._errors import StartError


def _read(path: Any, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise StartError(f"tls.{what} {path}: cannot read: {e.strerror}") from None


def server_context(tls: Any) -> ssl.SSLContext:
    """The files loaded the way the HTTP port will: the context the data connections use
    (a client certificate required with client_ca_file); StartError naming the file if they
    do not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except (ssl.SSLError, OSError) as e:
        raise StartError(f"tls: cert_file {tls.cert_file} with key_file {tls.key_file} does "
                         f"not load: {e}") from None
    if tls.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except (ssl.SSLError, OSError) as e:
            raise StartError(f"tls: client_ca_file {tls.client_ca_file} does not load: {e}"
                             ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def grpc_credentials(tls: Any) -> grpc.ServerCredentials:
    ca = tls.client_ca_file
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file, "key_file"), _read(tls.cert_file, "cert_file"))],
        root_certificates=_read(ca, "client_ca_file") if ca is not None else None,
        require_client_auth=ca is not None)


def uvicorn_options(tls: Any) -> dict[str, Any]:
    """Keyword arguments for uvicorn.Config."""
    if tls is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": str(tls.cert_file),
                               "ssl_keyfile": str(tls.key_file)}
    if tls.client_ca_file is not None:
        options.update(ssl_ca_certs=str(tls.client_ca_file), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options
