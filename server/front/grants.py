"""Access per dataset (issue 41): who the caller is, and which datasets it may use.

A `Grant` is one credential's rights: a bearer token (read from its `token_file` at start) or,
under mutual TLS, a client certificate identity, and the datasets it may read. `Grants`
answers, for a call's `authorization` header and certificate, which grant it holds (None: it
is a stranger, answered UNAUTHENTICATED). Without `server.grants` it keeps today's rules: no
auth, everyone holds OPEN; the shared token alone, its holder holds SHARED. With grants the
shared token, if configured too, stays a credential for every dataset (an operator's).

Where it is checked: every gRPC call but health's Check (`GrantInterceptor`, which puts the
caller's grant in `CALLER` for the handler), DataService.coordinates (Describe, Provenance and
every stream's coordinates, so the shared-batch cache and the prefix cache, reached only
through checked coordinates, too), ListDatasets (only the grant's own), the data connection
(its claim proves the stream's own token, or comes with the stream's own certificate) and
HTTP (front/http.py: operator paths need an operator grant).

Tokens are compared with hmac.compare_digest against every grant's (time independent of
which one matches, or where a wrong one differs).
"""

from __future__ import annotations

import contextvars
import hmac
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from .._errors import StartError
from .auth import EXEMPT_GRPC_METHODS, MIN_TOKEN_CHARS, REFUSAL, read_token


@dataclass(frozen=True)
class Grant:
    """One credential's rights. `datasets` None: every dataset. Immutable, shared by calls."""

    name: str
    datasets: frozenset[str] | None
    operator: bool
    token: bytes | None = None  # the bearer token this grant is held by
    client_cert: str | None = None  # or the certificate identity (see Identity.matches)

    def allows(self, dataset: str) -> bool:
        return self.datasets is None or dataset in self.datasets

    def visible(self, names: Iterable[str]) -> list[str]:
        """Those of `names` this grant may see, sorted."""
        return sorted(n for n in names if self.allows(n))


OPEN = Grant("anyone", None, operator=True)  # no auth configured
SHARED = "shared-token"  # the name the single shared token's grant goes by


@dataclass(frozen=True)
class Identity:
    """A client certificate, as far as grants look at it."""

    common_name: str | None = None
    subject: str | None = None  # RFC 4514, as gRPC prints it (`CN=trainer-b,O=team`)
    alt_names: frozenset[str] = frozenset()  # SAN values (DNS names, URIs, emails, IPs)

    def matches(self, spec: str) -> bool:
        """`CN=x` (the common name, or the whole subject), `DNS:x`, `URI:x`, `email:x`,
        `IP:x` (a subject alternative name), else the whole subject."""
        kind, _, value = spec.partition(":")
        if kind in ("DNS", "URI", "email", "IP") and value:
            return value in self.alt_names
        if spec.startswith("CN=") and spec[3:] == self.common_name:
            return True
        return self.subject is not None and spec == self.subject

    @classmethod
    def of_grpc(cls, auth: dict[str, list[bytes]]) -> Identity | None:
        """From grpc's auth_context(); None without a client certificate."""
        def one(key: str) -> str | None:
            values = auth.get(key) or []
            return values[0].decode("utf-8", "replace") if values else None

        if not auth.get("x509_pem_cert"):
            return None
        alt = {v.decode("utf-8", "replace") for key in ("x509_subject_alternative_name",
                                                         "x509_dns", "x509_uri", "x509_email")
               for v in auth.get(key) or []}
        return cls(one("x509_common_name"), one("x509_subject"), frozenset(alt))

    @classmethod
    def of_ssl(cls, cert: dict[str, Any] | None) -> Identity | None:
        """From ssl's getpeercert(); None without one."""
        if not cert:
            return None
        rdns = [(k, v) for rdn in cert.get("subject", ()) for k, v in rdn]
        short = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
                 "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST"}
        common = next((v for k, v in rdns if k == "commonName"), None)
        subject = ",".join(f"{short.get(k, k)}={v}" for k, v in reversed(rdns))
        alt = frozenset(v for _, v in cert.get("subjectAltName", ()))
        return cls(common, subject or None, alt)


class Grants:
    """The grants a server was started with; read by every call (immutable after start)."""

    def __init__(self, grants: Iterable[Grant], shared_token: bytes | None = None) -> None:
        self.grants = tuple(grants)
        self.shared = (Grant(SHARED, None, operator=True, token=shared_token)
                       if shared_token is not None else None)
        self._tokens = [g for g in (*self.grants, self.shared) if g is not None and g.token]
        self._certs = [g for g in self.grants if g.client_cert]

    @classmethod
    def of(cls, settings: Any) -> Grants:
        """From ServerSettings; StartError naming the file for a token that does not load."""
        made = []
        for g in settings.grants:
            token = None
            if g.token_file is not None:
                token = _read_grant_token(g.token_file, g.name)
            made.append(Grant(g.name, None if "*" in g.datasets else frozenset(g.datasets),
                              g.operator, token, g.client_cert))
        tokens = [g.token for g in made if g.token]
        if len(set(tokens)) != len(tokens):
            raise StartError("grants: two grants have the same token (each needs its own)")
        return cls(made, read_token(settings))

    @property
    def enabled(self) -> bool:
        """Grants were configured: callers see only their own datasets."""
        return bool(self.grants)

    @property
    def required(self) -> bool:
        """Calls must carry a credential (a token, or a granted certificate)."""
        return bool(self.grants) or self.shared is not None

    @property
    def by_certificate(self) -> bool:
        return bool(self._certs)

    def of_bearer(self, header: str | bytes | None) -> Grant | None:
        """The grant whose token `header` (`Bearer <token>`) carries."""
        if header is None:
            return None
        if isinstance(header, str):
            header = header.encode("utf-8", "replace")
        scheme, _, given = header.strip().partition(b" ")
        given = given.strip()
        if scheme.lower() != b"bearer" or len(given) < MIN_TOKEN_CHARS:
            return None
        found = None
        for grant in self._tokens:  # all compared: the time does not say which matched
            assert grant.token is not None
            if hmac.compare_digest(given, grant.token):
                found = grant
        return found

    def of_certificate(self, identity: Identity | None) -> Grant | None:
        if identity is None:
            return None
        return next((g for g in self._certs if identity.matches(g.client_cert or "")), None)

    def of_call(self, header: str | bytes | None, identity: Identity | None) -> Grant | None:
        """The caller's grant: by its token, else by its certificate; OPEN where nothing is
        required; None: refuse."""
        if not self.required:
            return OPEN
        return self.of_bearer(header) or self.of_certificate(identity)


def _read_grant_token(path: Any, name: str) -> bytes:
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise StartError(f"grants {name}: token_file {path}: cannot read: {e}") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise StartError(f"grants {name}: token_file {path}: expected at least "
                         f"{MIN_TOKEN_CHARS} characters without spaces "
                         "(e.g. `openssl rand -hex 32`)")
    return token.encode()


# The grant of the gRPC call being handled, set by GrantInterceptor's wrapper around the
# handler (a call's handler runs in a task of its own, so tasks it starts inherit it).
CALLER: contextvars.ContextVar[Grant] = contextvars.ContextVar("stoker_caller", default=OPEN)


def grant_of(context: grpc.aio.ServicerContext, grants: Grants) -> Grant | None:
    header = next((v for k, v in context.invocation_metadata() or () if k == "authorization"),
                  None)
    identity = Identity.of_grpc(context.auth_context()) if grants.by_certificate else None
    return grants.of_call(header, identity)


def _guarded(handler: grpc.RpcMethodHandler, grants: Grants) -> grpc.RpcMethodHandler:
    """`handler` behind a check of its caller's grant, before anything of its request is
    read; the grant goes into CALLER for the handler."""
    async def admit(context: grpc.aio.ServicerContext) -> None:
        grant = grant_of(context, grants)
        if grant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        CALLER.set(grant)  # type: ignore[arg-type]

    def unary(behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await admit(context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        return call

    def streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(behavior):  # writes with context.write
            async def written(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await admit(context)
                return await behavior(request, context)
            return written

        async def generated(request: Any, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[Any]:
            await admit(context)
            responses = behavior(request, context)
            if hasattr(responses, "__aiter__"):
                async for response in responses:
                    yield response
            else:
                for response in responses:
                    yield response
        return generated

    h = handler
    if h.request_streaming and h.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            streaming(h.stream_stream), h.request_deserializer, h.response_serializer)
    if h.request_streaming:
        return grpc.stream_unary_rpc_method_handler(
            unary(h.stream_unary), h.request_deserializer, h.response_serializer)
    if h.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            streaming(h.unary_stream), h.request_deserializer, h.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        unary(h.unary_unary), h.request_deserializer, h.response_serializer)


class GrantInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health's Check must hold a grant (a token, or a granted certificate);
    without one it is refused UNAUTHENTICATED before its handler reads its request."""

    def __init__(self, grants: Grants) -> None:
        self._grants = grants

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in EXEMPT_GRPC_METHODS:
            return handler
        return _guarded(handler, self._grants)
