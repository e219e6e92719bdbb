"""The Ray actors of a stoker fleet: one runs a data server, one keeps the fleet's addresses.

Plain classes: stoker.integrations.ray makes them actors (`ray.remote(...).options(...)`) with
the resources each asks for, so that this module imports no Ray itself.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stoker.server import ServerProcess, write_config

# Run before the server's own interpreter: prctl(PR_SET_PDEATHSIG, SIGKILL), then exec the
# server (same pid, so its signals and exit code are the server's). A server would outlive
# its actor otherwise (ray.kill, a node's raylet ending the worker, the driver exiting),
# keeping its port, its CPUs and its place on the trainers' lists. Linux only: elsewhere the
# server runs unwrapped. argv[1] is the actor's pid: if it died before prctl, exit at once.
DIE_WITH_PARENT = ("import ctypes, os, signal, sys; "
                   "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0); "
                   "os.getppid() == int(sys.argv[1]) or os._exit(70); "
                   "os.execv(sys.argv[2], sys.argv[2:])")


def die_with_parent() -> list[str]:
    """ServerProcess's `wrap` that ends the server when the process that started it ends."""
    if not sys.platform.startswith("linux"):
        return []
    return [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid())]


class ServerActor:
    """One `stoker serve` child process on this actor's node, bound to the node's IP address.

    Ray runs an actor's calls one at a time on the thread that started the server, which
    PR_SET_PDEATHSIG ties the server's life to (so the actor keeps max_concurrency 1)."""

    def __init__(self, config: str | Mapping[str, Any], workers: int,
                 env: Mapping[str, str] | None, log_level: str) -> None:
        import ray

        if isinstance(config, Mapping):  # written here: the driver's disk may not be ours
            folder = Path(tempfile.mkdtemp(prefix="stoker-fleet-"))
            config = str(write_config(folder / "config.yaml", dict(config)))
        self.node_id = ray.get_runtime_context().get_node_id()
        self.server = ServerProcess(config, workers=workers,
                                    host=ray.util.get_node_ip_address(), env=dict(env or {}),
                                    log_level=log_level, wrap=die_with_parent()).start()

    def info(self) -> dict[str, Any]:
        assert self.server.proc is not None
        return {"address": self.server.address, "http_url": self.server.http_url,
                "pid": self.server.proc.pid, "node_id": self.node_id}

    def poll(self) -> int | None:
        """The server's exit code, None while it runs."""
        assert self.server.proc is not None
        return self.server.proc.poll()

    def stop(self) -> int:
        """Drain: SIGTERM, the server refuses new credits, finishes what it holds within its
        grace_seconds and exits; its exit code."""
        return self.server.stop()


class AddressBook:
    """The fleet's current "host:port" list, which trainers' resolvers read (a named actor,
    so that any process of the cluster finds it by the fleet's name)."""

    def __init__(self) -> None:
        self.addresses: list[str] = []

    def set(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)

    def get(self) -> list[str]:
        return self.addresses
