"""The HTTP control plane (FastAPI on uvicorn). For now: /healthz; the rest comes later.

uvicorn runs on its own thread with its own event loop: it must not install signal handlers
(the server's lifecycle owns SIGTERM/SIGINT), and off the main thread it does not.
"""

from __future__ import annotations

import socket
import threading

import uvicorn
from fastapi import FastAPI


def make_app() -> FastAPI:
    app = FastAPI(title="stoker data server", version="1")

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """Alive: the process answers. (Readiness is /readyz, in a later version.)"""
        return {"status": "ok"}

    return app


class HttpServer:
    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        # Listening now, before uvicorn's thread runs: connections made as soon as the server
        # reports ready wait in the backlog instead of being refused.
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(make_app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="stoker-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
