"""The bearer token: one shared secret that every gRPC call and HTTP request must carry.

    authorization: Bearer <token>       (gRPC metadata, or the HTTP header)

Exempt, because the callers that need them send no token: gRPC health's Check
(`grpc.health.v1.Health/Check`, the kubelet's gRPC probe and grpc-health-probe) and HTTP
`/healthz` and `/readyz` (its HTTP probes). Neither names a dataset. Health's Watch is not
exempt: a watch is a call held open, which a stranger could open by the thousand. Everything
else, reflection included, needs the token. A refusal says only that the token is missing or
wrong: it never names a dataset, a method's arguments or the configured token source.

Tokens are compared with hmac.compare_digest (time independent of where they differ).
The check itself, for this token and the grants' own, is in front/grants.py (one place for
gRPC, HTTP and the data connection).
"""

from __future__ import annotations

import os
from typing import Any

from .._errors import StartError

MIN_TOKEN_CHARS = 16
EXEMPT_GRPC_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
EXEMPT_HTTP_PATHS = frozenset({"/healthz", "/readyz"})
REFUSAL = "missing or wrong bearer token (send `authorization: Bearer <token>`)"


def read_token(settings: Any) -> bytes | None:
    """The token the ServerSettings name (file or environment variable), or None (no auth).
    Raises StartError for an empty or short token; the message names where it came from,
    never the token."""
    if settings.auth_token_file is not None:
        where = str(settings.auth_token_file)
        try:
            token = settings.auth_token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise StartError(f"auth_token_file {where}: cannot read: {e}") from None
    elif settings.auth_token_env is not None:
        where = f"environment variable {settings.auth_token_env}"
        token = os.environ.get(settings.auth_token_env, "").strip()
    else:
        return None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise StartError(f"auth token from {where}: expected at least {MIN_TOKEN_CHARS} "
                         "characters without spaces (e.g. `openssl rand -hex 32`)")
    return token.encode()
