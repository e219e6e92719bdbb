"""The server's lifecycle, as four steps: start, serve, drain, stop.

start:  signal handlers -> worker processes (they open the datasets) -> data-socket listener
        -> gRPC port -> HTTP port -> health SERVING -> "ready" line
serve:  until SIGTERM or SIGINT; gRPC health follows the worker pool meanwhile
drain:  health NOT_SERVING -> new credits answered UNAVAILABLE in-band (clients ask other
        servers) -> stop accepting streams, let the batches in flight finish within the grace
        period
stop:   what started, in reverse: HTTP -> gRPC (health NOT_SERVING first) -> data-socket
        listener -> workers (shm freed) -> signal handlers

Each part's stop goes on one AsyncExitStack as soon as its start succeeds, so a start that
fails at any step, and a serve() task that its embedding program cancels, undo exactly what
had started; a cancelled serve() stops at once, without the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ._config import Config
from ._errors import StartError
from .front import limits, tls
from .front.data_listener import DataSockets
from .front.grants import GrantInterceptor, Grants
from .front.http import HttpLimits, HttpServer
from .front.listen import address, taken
from .front.service import SERVICE_NAME, DataService, client_of
from .order import sampling
from .pool import depth
from .pool.workers import DatasetMeta, WorkerPool

__all__ = ["Started", "drain", "serve", "start"]

log = logging.getLogger("stoker.server")

# Frames are at most MAX_FRAME_BYTES; requests are small (their limit, max_request_bytes,
# comes from the config: grpc.max_receive_message_length; so do the connection limits,
# limits.grpc_options, and keepalive pings there: they let a server notice a vanished client,
# and free what its streams held, within silent_client_seconds).
# No SO_REUSEPORT: a second server on a taken port must fail, not share it silently.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # Clients ping every 10 s to notice a frozen server; accept that (the default allows one
    # ping per 5 minutes without data, and answers more with GOAWAY too_many_pings).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


HEALTH_EVERY = 1.0  # seconds between looks at the worker pool for gRPC health


async def _watch_workers(pool: WorkerPool, health_servicer: Any) -> None:
    """gRPC health follows the pool, as /readyz does: NOT_SERVING while no worker is up
    (every replacement failed to start, or the dispatcher failed), SERVING again when one is."""
    serving = True
    while True:
        await asyncio.sleep(HEALTH_EVERY)
        up = pool.status()["workers"] > 0
        if up != serving:
            serving = up
            status = (health_pb2.HealthCheckResponse.SERVING if up
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)
            log.log(logging.INFO if up else logging.ERROR, "workers %s: gRPC health %s",
                    "up" if up else "all gone", "SERVING" if up else "NOT_SERVING")


@dataclass(frozen=True)
class Started:
    """What start() brought up (each part's stop is on the exit stack already)."""

    pool: WorkerPool
    service: DataService
    grpc_server: grpc.aio.Server
    health: health.aio.HealthServicer
    grpc_port: int
    http_port: int
    data_port: int | None  # the data connections' port
    auth: bool  # calls must carry a credential (the bearer token, or a grant's)
    nofile: int  # the soft limit on open files, raised to the hard one


async def serve(config: Config) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully. Raises StartError.

    Embedded, as a task in a program's own loop: cancelling the task stops the server at once
    (streams are cut, no drain) and leaves no port, thread, worker, segment or signal handler."""
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        started = await start(config, stack, stop.set)
        # Not announced when a signal came during the start: that server is about to stop.
        if not stop.is_set():
            _announce(config, started)
        await _serve_until(stop, started)
        await drain(started, config.server.grace_seconds)
    log.info("stopped")
    print(json.dumps({"event": "stopped"}), flush=True)


async def start(config: Config, stack: contextlib.AsyncExitStack,
                on_signal: Callable[[], None]) -> Started:
    """Start every part in order, pushing each one's stop on `stack` once it runs.
    Raises StartError naming the part that could not start."""
    settings = config.server
    _on_signals(stack, on_signal)  # first: a signal during the start stops cleanly
    # Before the workers start: they inherit the limit.
    nofile, nofile_hard = limits.raise_nofile()
    if (warning := limits.nofile_warning(settings, nofile, nofile_hard)) is not None:
        log.warning("%s", warning)
    sampling.ORDERS.resize(int(settings.max_order_cache_bytes))
    # Secrets and certificates first: a bad one fails the start before any worker runs.
    grants = Grants.of(settings)  # the shared token and the grants' own tokens
    tls_context = tls.server_context(settings.tls) if settings.tls is not None else None
    _check_ports(settings)  # before the workers: a taken port fails in a moment, not minutes
    pool = WorkerPool(config, settings.worker_count)
    meta = await _start_workers(stack, pool)
    if (small := depth.capacity_warning(meta, settings)) is not None:
        log.warning("%s", small)
    # The data connections (TLS under server.tls, the proof of the stream's own credential)
    # listen before gRPC does: the first stream may ask for one, and streams end before
    # they close.
    data_sockets = _listening(
        "data socket", settings.host, settings.data_port,
        lambda: DataSockets(settings.host, settings.data_port, tls=tls_context))
    data_sockets.start()
    stack.callback(data_sockets.close)
    service = DataService(config, pool, meta, data_sockets)
    grpc_server, health_servicer, grpc_port = await _start_grpc(stack, config, service, grants)
    http = _listening("HTTP", settings.host, settings.http_port,
                      lambda: HttpServer(settings.host, settings.http_port, service, grants=grants,
                                         tls=settings.tls, limits=HttpLimits.of(settings)))
    http.start()
    stack.callback(http.stop)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Started(pool, service, grpc_server, health_servicer, grpc_port, http.port,
                   data_sockets.port,
                   auth=grants.required, nofile=nofile)


def _announce(config: Config, started: Started) -> None:
    """One machine-readable line: tests and scripts wait on it instead of sleeping."""
    settings, meta = config.server, started.service.meta
    print(json.dumps({"event": "ready", "grpc_port": started.grpc_port,
                      "http_port": started.http_port, "data_port": started.data_port,
                      "tls": settings.tls is not None, "auth": started.auth,
                      "host": settings.host, "workers": settings.worker_count,
                      "datasets": sorted(meta), "nofile": started.nofile}), flush=True)
    log.info("serving %s on %s (gRPC), port %d (HTTP) with %d workers",
             ", ".join(sorted(meta)), address(settings.host, started.grpc_port),
             started.http_port, settings.worker_count)
    log.info("streams may hold %s of shared memory",
             started.service.admission.held_cap_says)


async def _serve_until(stop: asyncio.Event, started: Started) -> None:
    """Serve until `stop` is set; gRPC health follows the worker pool meanwhile."""
    watch = asyncio.create_task(_watch_workers(started.pool, started.health))
    try:
        await stop.wait()
    finally:
        watch.cancel()
        await asyncio.wait([watch])


async def drain(started: Started, grace: float) -> None:
    """Stop taking work and let the batches in flight finish, for at most `grace` seconds."""
    log.info("shutting down: draining streams for up to %.1fs", grace)
    await started.health.enter_graceful_shutdown()
    started.service.draining = True  # credits from now on are answered UNAVAILABLE, in-band
    await started.grpc_server.stop(grace)


# -- each part's start, and its stop pushed on the stack --------------------------------------
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _on_signals(stack: contextlib.AsyncExitStack, on_signal: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call `on_signal` until the stack closes; then the handlers the
    program had before are back (asyncio.run's own SIGINT handler among them). Only on the
    main thread, as asyncio's signal handlers are."""
    loop = asyncio.get_running_loop()
    for sig in SIGNALS:
        before = signal.getsignal(sig)
        loop.add_signal_handler(sig, on_signal)
        stack.callback(_restore_signal, loop, sig, before)


def _restore_signal(loop: asyncio.AbstractEventLoop, sig: signal.Signals, before: Any) -> None:
    loop.remove_signal_handler(sig)
    if before is not None:  # None: set outside Python, nothing to put back
        signal.signal(sig, before)


async def _start_workers(stack: contextlib.AsyncExitStack,
                         pool: WorkerPool) -> dict[str, DatasetMeta]:
    """Start the pool's workers (blocking: on a thread); what each dataset holds."""
    loop = asyncio.get_running_loop()
    starting = loop.run_in_executor(None, pool.start, loop)

    async def close() -> None:
        # start() and close() both walk the pool's workers: a start cut short by a
        # cancellation runs to its end on its thread before close() stops what it started.
        await asyncio.wait([starting])
        await loop.run_in_executor(None, pool.close)

    stack.push_async_callback(close)  # before start() ends: it stops those that did start
    return await asyncio.shield(starting)


async def _start_grpc(stack: contextlib.AsyncExitStack, config: Config, service: DataService,
                      grants: Grants) -> tuple[grpc.aio.Server, Any, int]:
    """The gRPC server, listening: (server, its health servicer, its port)."""
    settings = config.server
    health_servicer = limits.LimitedHealth(service.admission, client_of)
    server = grpc.aio.server(
        options=[*GRPC_OPTIONS, *limits.grpc_options(settings),
                 ("grpc.max_receive_message_length", int(settings.max_request_bytes))],
        interceptors=[GrantInterceptor(grants)] if grants.required else None,
        maximum_concurrent_rpcs=limits.concurrent_rpcs(settings))
    server.add_generic_rpc_handlers([service.handler()])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Reflection: grpcurl and friends discover the services without the .proto file.
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    where = address(settings.host, settings.port)
    try:
        if settings.tls is None:
            port = server.add_insecure_port(where)
        else:
            port = server.add_secure_port(where, tls.grpc_credentials(settings.tls))
    except RuntimeError as e:
        raise StartError(f"cannot listen on {where} (gRPC): {e}") from None
    await server.start()
    stack.push_async_callback(_stop_grpc, server, health_servicer)
    return server, health_servicer, port


async def _stop_grpc(server: grpc.aio.Server, health_servicer: Any) -> None:
    """Health says NOT_SERVING before the port closes; streams still open are cut (after
    drain() there are none, and this stop finds the server stopped already)."""
    await health_servicer.enter_graceful_shutdown()
    await server.stop(None)


def _check_ports(settings: Any) -> None:
    """StartError naming every configured port that is taken, not only the first: an
    operator moving off a taken gRPC port should not meet the HTTP one next. A check, not a
    reservation: each part binds its own port later, and fails there as before if another
    process takes it in between."""
    ports = [("gRPC", settings.port), ("HTTP", settings.http_port),
             ("data socket", settings.data_port)]
    problems = [f"cannot listen on {address(settings.host, port)} ({what}): {why}"
                for what, port in ports if port and (why := taken(settings.host, port))]
    for i, (what, port) in enumerate(ports):
        problems += [f"{what} and {other} are both given port {port}"
                     for other, same in ports[i + 1:] if port and same == port]
    if problems:
        raise StartError("; ".join(problems))


_T = TypeVar("_T")


def _listening(what: str, host: str, port: int, make: Callable[[], _T]) -> _T:
    """make() a part that listens on (host, port); a port it cannot take is a StartError."""
    try:
        return make()
    except OSError as e:
        raise StartError(f"cannot listen on {address(host, port)} ({what}): "
                         f"{e.strerror}") from None
