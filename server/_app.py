"""The server process's lifecycle: start in order, serve, shut down in steps.

start:    worker processes (they open the datasets) -> gRPC port -> HTTP port -> "ready" line
shutdown: (on SIGTERM or SIGINT) health NOT_SERVING -> new credits answered UNAVAILABLE
          in-band (clients ask other servers) -> stop accepting streams, let the batches in
          flight finish within the grace period -> stop HTTP -> stop workers (shm freed)
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import _tls
from ._auth import TokenInterceptor, read_token
from ._config import Config
from ._datasocket import DataSockets
from ._http import HttpServer
from ._service import SERVICE_NAME, DataService
from ._workers import StartError, WorkerPool

log = logging.getLogger("stoker.server")

# Frames are at most MAX_FRAME_BYTES; requests are small (their limit, max_request_bytes,
# comes from the config: grpc.max_receive_message_length). Keepalive pings let a server notice
# a vanished client (and free what its stream held) without waiting for TCP to time out.
# No SO_REUSEPORT: a second server on a taken port must fail, not share it silently.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # Clients ping every 10 s to notice a frozen server; accept that (the default allows one
    # ping per 5 minutes without data, and answers more with GOAWAY too_many_pings).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


async def serve(config: Config) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully. Raises StartError."""
    settings = config.server
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # first: a signal during start stops cleanly
        loop.add_signal_handler(sig, stop.set)
    # Secrets and certificates first: a bad one fails the start before any worker runs.
    token = read_token(settings)
    if settings.tls is not None:
        _tls.check(settings.tls)
    pool = WorkerPool(config, settings.worker_count)
    try:
        meta = await loop.run_in_executor(None, pool.start)
        service = DataService(config, pool, meta)
        health_servicer = health.aio.HealthServicer()
        server = grpc.aio.server(
            options=[*GRPC_OPTIONS, ("grpc.max_receive_message_length",
                                     int(settings.max_request_bytes))],
            interceptors=[TokenInterceptor(token)] if token is not None else None)
        server.add_generic_rpc_handlers([service.handler()])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        # Reflection: grpcurl and friends discover the services without the .proto file.
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        address = grpc_address(settings.host, settings.port)
        try:
            if settings.tls is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, _tls.grpc_credentials(settings.tls))
        except RuntimeError as e:
            raise StartError(f"cannot listen on {address} (gRPC): {e}") from None
        await server.start()
        # The data socket is plain TCP: under TLS it is not offered (clients that ask for one
        # get their payloads in gRPC frames, encrypted like the rest).
        data_sockets = None
        if settings.tls is None:
            try:
                data_sockets = DataSockets(settings.host, settings.data_port)
            except OSError as e:
                await server.stop(None)
                raise StartError(f"cannot listen on "
                                 f"{grpc_address(settings.host, settings.data_port)}"
                                 f" (data socket): {e.strerror}") from None
            data_sockets.start()
        service.data_sockets = data_sockets
        try:
            http = HttpServer(settings.host, settings.http_port, service, token=token,
                              tls=settings.tls)
        except OSError as e:
            await server.stop(None)
            if data_sockets is not None:
                data_sockets.close()
            raise StartError(f"cannot listen on {grpc_address(settings.host, settings.http_port)}"
                             f" (HTTP): {e.strerror}") from None
        http.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

        # One machine-readable line: tests and scripts wait on it instead of sleeping.
        # Not printed when a signal came during the start: that server is about to stop.
        if not stop.is_set():
            print(json.dumps({"event": "ready", "grpc_port": port, "http_port": http.port,
                              "data_port": data_sockets.port if data_sockets else None,
                              "tls": settings.tls is not None, "auth": token is not None,
                              "host": settings.host, "workers": settings.worker_count,
                              "datasets": sorted(meta)}), flush=True)
            log.info("serving %s on %s (gRPC), port %d (HTTP) with %d workers",
                     ", ".join(sorted(meta)), grpc_address(settings.host, port), http.port,
                     settings.worker_count)
        watch = asyncio.create_task(_watch_workers(pool, health_servicer))
        await stop.wait()
        watch.cancel()

        log.info("shutting down: draining streams for up to %.1fs", settings.grace_seconds)
        await health_servicer.enter_graceful_shutdown()
        service.draining = True  # credits from now on are answered UNAVAILABLE, in-band
        await server.stop(settings.grace_seconds)
        if data_sockets is not None:
            data_sockets.close()
        http.stop()
    finally:
        await loop.run_in_executor(None, pool.close)
    log.info("stopped")
    print(json.dumps({"event": "stopped"}), flush=True)
