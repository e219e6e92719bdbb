"""The HTTP control plane (FastAPI on uvicorn): probes, metrics, and what the server serves.

    GET /healthz             alive (the process answers)
    GET /readyz              200 when workers are up and the server takes streams; 503 while
                             draining (SIGTERM) or with no worker
    GET /metrics             Prometheus text format (see front/metrics.py)
    GET /v1/datasets         every dataset: name, format, samples, fields, fingerprint
    GET /v1/datasets/{name}  one of them (404 naming the served ones)
    GET /v1/stats            live rates over the last seconds, streams, clients' data stall
    GET /openapi.json, /docs the OpenAPI document FastAPI generates from these, and its
                             viewer (Swagger UI; /redoc too), served with its scripts from
                             /static-offline-docs: a cluster without internet sees it too
    GET /                    a live page: throughput, streams, clients' stall (polls /v1/stats)

With a bearer token configured (front/auth.py) every path but /healthz and /readyz answers 401
without it, and says nothing else. With `server.grants` (front/grants.py) the credential is
any grant's token, or a granted client certificate, and the operator paths (/metrics,
/v1/stats, /v1/datasets, the live page /) answer 403 to a grant without `operator: true`:
they name every dataset and what each is doing. With `tls`, the port speaks HTTPS only
(front/tls.py).

Connections are bounded (`BoundedH11`): in all and per client address (503 naming the limit,
then closed), and in time until a request's head is complete (408, then closed): uvicorn has
no such timeout, and a half-sent head held a descriptor for ever.

uvicorn runs on its own thread with its own event loop: it must not install signal handlers
(the server's lifecycle owns SIGTERM/SIGINT), and off the main thread it does not. Handlers
only read: counters (thread-safe), the pool's status (under its lock), immutable metadata.
"""

from __future__ import annotations

import asyncio
import collections
import http
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import h11
import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from uvicorn.protocols.http.h11_impl import H11Protocol

from .auth import EXEMPT_HTTP_PATHS, REFUSAL
from .grants import Grants, Identity
from .listen import listen
from .memory_stats import memory_stats
from .tls import uvicorn_options

PAGE = Path(__file__).parent / "static" / "index.html"
# Connections accepted in one event-loop step (and uvicorn's listen backlog).
ACCEPT_BATCH = 64


class Field(BaseModel):
    name: str
    dtype: str
    shape: list[int]


class FingerprintView(BaseModel):
    """What this server's copy of the dataset is (docs/design.md, "Fingerprint"), as the JSON
    of /v1/datasets shows it (the dataset's own is order.fingerprint.Fingerprint)."""

    digest: str  # "sha256:<hex>" of the config and the listing
    objects: int
    bytes: int


class Dataset(BaseModel):
    name: str
    format: str
    num_samples: int
    fields: list[Field]
    fingerprint: FingerprintView | None = None
    # A mixture: its components, in the order of the `source` field's values.
    components: list[str] = []


class Readiness(BaseModel):
    ready: bool
    workers: int
    draining: bool


class ClientWindow(BaseModel):
    window: int
    why: str
    budget_batches: int


class Capacity(BaseModel):
    workers: int
    samples_per_second: float  # measured; 0.0 before a batch was built


class DatasetRates(BaseModel):
    batches_per_s: float
    samples_per_s: float
    bytes_per_s: float
    streams: int = 0
    client_stalls: list[float] = []
    # A mixture: samples built of each component since the server started.
    components: dict[str, int] = {}
    # Each reporting client's window of batches in flight and why (docs/tuning.md).
    client_windows: list[ClientWindow] = []


class Memory(BaseModel):
    front_end_rss_anon_bytes: int
    workers_rss_anon_bytes: int
    legacy_order_cache_bytes: int
    legacy_order_cache_max_bytes: int
    token_plan_cache_bytes: int
    token_plan_cache_max_bytes: int


class Stats(BaseModel):
    window_seconds: float
    workers: int
    queued_batches: int
    building_batches: int
    # Built batches the front end holds: being sent, or kept for other jobs.
    held_batches: int
    # Shared memory the streams hold for their clients (batches being sent, or lent and not
    # yet released): freed when a stream ends, a silent client's within
    # silent_client_seconds (docs/deployment.md).
    stream_held_bytes: int = 0
    draining: bool
    # Workers killed and replaced for a batch over batch_timeout_seconds, since the start.
    worker_timeouts: int = 0
    datasets: dict[str, DatasetRates]
    # What this server can do: its clients' windows follow it (docs/tuning.md).
    capacity: Capacity | None = None
    # Resident memory and the order and plan caches against their caps (memory_stats.py).
    memory: Memory | None = None


# Paths that name every dataset or what each is doing: operators only, under grants.
OPERATOR_PATHS = ("/metrics", "/v1/stats", "/v1/datasets")
NOT_OPERATOR = "this path needs an operator's credential (a grant with operator: true)"


def _operator_path(path: str) -> bool:
    return path == "/" or any(path == p or path.startswith(p + "/") for p in OPERATOR_PATHS)


def make_app(service: Any = None, grants: Grants | None = None,
             certificates: dict[Any, Identity] | None = None) -> FastAPI:
    """The app; `service` is the DataService (None: /healthz only, for tests of the shell);
    `grants`: the credentials every request but the probes must carry (None, or none
    required: no auth); `certificates`: the client certificate of each connection, by its
    (host, port), kept by BoundedH11 under mutual TLS."""
    # FastAPIOffline: FastAPI whose /docs and /redoc load Swagger UI and ReDoc from files in
    # that package, not from a CDN (blank pages on a cluster without internet access).
    app = FastAPIOffline(title="stoker data server", version="1",
                         description="Control plane of a stoker data server; batches travel "
                                     "over gRPC (stoker.v1.DataService).")

    if grants is not None and grants.required:
        known = certificates if certificates is not None else {}

        @app.middleware("http")
        async def require_grant(request: Request, call_next: Any) -> Response:
            path = request.url.path
            if path in EXEMPT_HTTP_PATHS:
                return await call_next(request)
            peer = (request.client.host, request.client.port) if request.client else None
            grant = grants.of_call(request.headers.get("authorization"), known.get(peer))
            if grant is None:
                return JSONResponse({"detail": REFUSAL}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            if not grant.operator and _operator_path(path):
                return JSONResponse({"detail": NOT_OPERATOR}, status_code=403)
            return await call_next(request)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """Alive: the process answers."""
        return {"status": "ok"}

    if service is None:
        return app

    def datasets() -> dict[str, Dataset]:
        return {name: Dataset(name=name, format=service.format_of(name),
                              num_samples=meta.num_samples,
                              fields=[Field(name=f, dtype=d, shape=list(s))
                                      for f, d, s in meta.fields],
                              fingerprint=None if meta.fingerprint is None else FingerprintView(
                                  digest=meta.fingerprint.digest,
                                  objects=meta.fingerprint.objects,
                                  bytes=meta.fingerprint.bytes),
                              components=list(getattr(meta.ordering, "names", ())))
                for name, meta in sorted(service.meta.items())}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> HTMLResponse:
        """The live page (static HTML; its script polls /v1/stats)."""
        return HTMLResponse(PAGE.read_text())

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
    def readyz(response: Response) -> Readiness:
        """Ready: at least one worker is up and the server is not draining."""
        workers = service.pool_status()["workers"]
        r = Readiness(ready=workers > 0 and not service.draining, workers=workers,
                      draining=service.draining)
        if not r.ready:
            response.status_code = 503
        return r

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    def metrics() -> Response:
        """Prometheus metrics, labelled by dataset."""
        return Response(generate_latest(service.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/datasets", response_model=list[Dataset])
    def list_datasets() -> list[Dataset]:
        """Every dataset this server serves."""
        return list(datasets().values())

    # {name:path}: a dataset name may hold a slash (`a/b`, sent as a/b or a%2Fb).
    @app.get("/v1/datasets/{name:path}", response_model=Dataset, responses={404: {}})
    def get_dataset(name: str) -> Dataset:
        """One dataset: format, size, fields (per-sample dtype and shape)."""
        found = datasets()
        if name not in found:
            raise HTTPException(404, f"no dataset {name!r}; this server serves "
                                     f"{', '.join(found)}")
        return found[name]

    @app.get("/v1/stats", response_model=Stats)
    def stats() -> Stats:
        """Live throughput by dataset, open streams, the data stall clients report."""
        live, pool = service.metrics.stats(), service.pool_status()
        return Stats(window_seconds=live["window_seconds"], workers=pool["workers"],
                     queued_batches=pool["queued"], building_batches=pool["building"],
                     held_batches=pool["held"], stream_held_bytes=service.admission.held,
                     draining=service.draining, worker_timeouts=pool.get("timeouts", 0),
                     datasets={k: DatasetRates(**v) for k, v in live["datasets"].items()},
                     capacity=Capacity(**live["capacity"]),
                     memory=Memory(**memory_stats(service.pool.pids())))

    return app


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP port's limits, from ServerSettings (their keys name them in refusals)."""

    max_connections: int
    per_client: int
    header_timeout: float

    @classmethod
    def of(cls, settings: Any) -> HttpLimits:
        return cls(settings.max_http_connections, settings.max_http_connections_per_client,
                   settings.http_header_timeout_seconds)


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with connection limits: a connection past max_http_connections
    or max_http_connections_per_client is answered 503 and closed at once; one that has not
    completed a request's head within http_header_timeout_seconds of connecting (or of its
    last response) is answered 408, if it sent part of one, and closed.

    `limits` and `open_of` are per server: `for_limits` makes a subclass holding them. Runs
    on uvicorn's event loop only (no lock)."""

    limits: ClassVar[HttpLimits]
    open_of: ClassVar[collections.Counter[str]]  # client host -> connections admitted
    # (host, port) -> the connection's client certificate, while it is open (mutual TLS)
    certificates: ClassVar[dict[Any, Identity]]

    @classmethod
    def for_limits(cls, limits: HttpLimits) -> type[BoundedH11]:
        return type("BoundedH11", (cls,), {"limits": limits, "open_of": collections.Counter(),
                                           "certificates": {}})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        identity = Identity.of_ssl(transport.get_extra_info("peercert"))
        if identity is not None and self.client:
            self.certificates[tuple(self.client)] = identity
        self._head_timer: asyncio.TimerHandle | None = None
        self._host = self.client[0] if self.client else "?"
        refusal = self._refusal()
        self._admitted = refusal is None
        if refusal is not None:
            self.connections.discard(self)  # never counted, by uvicorn either
            self._answer(503, refusal)
            return
        self.open_of[self._host] += 1
        self._arm()

    def _refusal(self) -> str | None:
        limits, mine = self.limits, self.open_of[self._host]
        if mine >= limits.per_client:
            return (f"connections: this client has {mine} open, "
                    f"max_http_connections_per_client={limits.per_client}")
        others = len(self.connections) - 1
        if others >= limits.max_connections:
            return (f"connections: this server has {others} open, "
                    f"max_http_connections={limits.max_connections}")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.client:
            self.certificates.pop(tuple(self.client), None)
        if self._admitted:
            self._admitted = False
            self.open_of[self._host] -= 1
            if not self.open_of[self._host]:
                del self.open_of[self._host]
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's head gets the same time

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # closed, or a request's head came: its response re-arms the timer
        if self.conn.trailing_data[0]:  # part of a head
            self._answer(408, "request: headers not complete within "
                              f"http_header_timeout_seconds={self.limits.header_timeout:g}")
        else:  # nothing at all since connecting or since the last response: just close
            self.transport.close()

    def _answer(self, status: int, message: str) -> None:
        """Answer `status` with `message` outside h11 (no request was read) and close."""
        body = message.encode()
        head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
                "content-type: text/plain; charset=utf-8\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.transport.close()


class HttpServer:
    def __init__(self, host: str, port: int, service: Any = None, *, limits: HttpLimits,
                 grants: Grants | None = None, tls: Any = None) -> None:
        # Listening now, before uvicorn's thread runs (front/listen.py says why).
        self._sock = listen(host, port)
        self.port: int = self._sock.getsockname()[1]
        # limit_concurrency backs BoundedH11's own cap, which names its key: one above it, as
        # uvicorn counts the connection it is answering. backlog is also how many connections
        # asyncio accepts in one go, before any is answered or closed: uvicorn's 2048 took
        # every descriptor left under a flood (EMFILE, and accepting paused for 1 s).
        protocol = BoundedH11.for_limits(limits)
        config = uvicorn.Config(make_app(service, grants, protocol.certificates),
                                log_level="warning", lifespan="off", http=protocol,
                                limit_concurrency=limits.max_connections + 1,
                                backlog=ACCEPT_BATCH,
                                **uvicorn_options(tls))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="stoker-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
